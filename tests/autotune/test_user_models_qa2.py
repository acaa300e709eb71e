"""Models as a new user holds them, tried on code that was not written around them (issue 15): a
tokenizer pads each call to its own longest sentence, so the chosen variant must take the user's next
batch at another length. An HF classifier fed its tokenizer's dict and a ``SentenceTransformer`` fed its
feature dict chose ``onnxruntime`` and failed on the next call ("Got invalid dimensions for input:
input_2 ... Got: 8 Expected: 16"): only the batch was dynamic for a model given as an object."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import torchnitro  # noqa: E402
from test_user_models import _tiny_sentence_transformer  # noqa: E402
from torchnitro.autotune.inputs import default_dynamic_dims  # noqa: E402
from torchnitro.autotune.recipe import get_recipe  # noqa: E402
from torchnitro.hardware import hardware_info  # noqa: E402
from torchnitro.hf import bert_config  # noqa: E402


def _tokenized(batch: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    """A tokenizer's output padded to its longest row (the last one, ``seq`` long)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, seq + 1, (batch,), generator=g)
    lens[-1] = seq
    mask = (torch.arange(seq)[None] < lens[:, None]).long()  # (B, T)
    ids = torch.randint(5, 30522, (batch, seq), generator=g) * mask
    return {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": mask}


def _classifier() -> nn.Module:
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    cfg = bert_config(vocab_size=30522, hidden_size=32, intermediate_size=64, num_labels=3)
    return AutoModelForSequenceClassification.from_config(cfg).eval()


class _Pair(nn.Module):
    def forward(self, ids: torch.Tensor, mask: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return ids * mask * scale.sum()


class _Image(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean((2, 3))


class _Features(nn.Module):
    def forward(self, features: dict) -> torch.Tensor:
        return features["input_ids"] * features["attention_mask"]


def test_the_sequence_dim_is_dynamic_where_the_inputs_carry_a_mask():
    x = _tokenized(2, 8, 0)
    assert default_dynamic_dims(_classifier(), (x["input_ids"], x["token_type_ids"], x["attention_mask"])) == {
        0: [0, 1], 1: [0, 1], 2: [0, 1]}
    # (ids, mask) of a script class by position; a (1,) tensor keeps its batch only
    assert default_dynamic_dims(_Pair(), (x["input_ids"], x["attention_mask"], torch.ones(1))) == {
        0: [0, 1], 1: [0, 1], 2: [0]}
    assert default_dynamic_dims(_Features(), (x,)) == {0: [0, 1]}  # a feature dict holding the mask
    assert default_dynamic_dims(_Image(), (torch.randn(2, 3, 8, 8),)) == {0: [0]}  # no mask: the batch only
    assert default_dynamic_dims(_Pair(), (x["input_ids"], x["attention_mask"], torch.ones(1)), padding_mask=0) == {
        0: [0, 1], 1: [0, 1], 2: [0]}


def _onnx_recipe() -> list[str]:
    why = get_recipe("onnxruntime").unavailable_reason(hardware_info())
    assert why is None, f"onnxruntime is a test dependency (the onnx extra) and must run here: {why}"
    return ["onnxruntime"]


def test_classifier_from_its_tokenizer_dict_takes_a_batch_of_another_length(fast_cfg):
    """Seen failing before the fix: ``InvalidArgument ... Got: 9 Expected: 16`` on the call below."""
    model = _classifier()
    om = torchnitro.optimize(model, _tokenized(4, 16, 0), fast_cfg(recipes=_onnx_recipe(), finalists=1,
                                                                  min_speedup=0.0, cache=False))
    assert om.recipe == "onnxruntime", [(c.recipe, c.status, c.reason) for c in om.report.candidates]
    assert [i["shape"][:2] for i in om.signature["inputs"]] == [[-1, -1]] * 3
    held = _tokenized(3, 9, 1)
    with torch.inference_mode():
        ref = model(**held).logits
    out = om(**held).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_sentence_transformer_variant_takes_a_feature_dict_of_another_length(tmp_path, fast_cfg, monkeypatch):
    """Seen failing before the fix: the ONNX variant chosen for a SentenceTransformer (one dict argument) raised
    ``Got invalid dimensions for input: input_2`` on sentences tokenized to another length; and its held-out
    sets had no smaller size at all (the size came from a top-level tensor, and a feature dict is none)."""
    import torchnitro.autotune.search as search

    model = _tiny_sentence_transformer(tmp_path / "st")
    texts = ["the cat sat on the mat", "a quick brown fox jumps over the lazy dog near the river", "hello"]
    feats = model.preprocess(texts)
    seen = []
    real = search.prepare_workload

    def spy(*args, **kwargs):
        wl = real(*args, **kwargs)
        seen.extend(tuple(h[0]["input_ids"].shape) for h in wl.held_out)
        return wl

    monkeypatch.setattr(search, "prepare_workload", spy)
    om = torchnitro.optimize(model, feats, fast_cfg(recipes=_onnx_recipe(), finalists=1, min_speedup=0.0, cache=False))
    T = feats["input_ids"].shape[1]
    assert (1, T // 2) in seen, seen  # the half-size set: batch and length
    assert om.recipe == "onnxruntime", [(c.recipe, c.status, c.reason) for c in om.report.candidates]
    held = model.preprocess(["what is the weather in paris today", "x", "another sentence entirely"])
    assert held["input_ids"].shape[1] != T
    with torch.inference_mode():
        ref = model(dict(held))["sentence_embedding"]
    out = om(dict(held))["sentence_embedding"]
    assert float(torch.nn.functional.cosine_similarity(out, ref).min()) > 0.9999


class _KeywordOnly(nn.Module):
    """A script class whose forward takes its inputs by keyword only."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(100, 16)
        self.mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))

    def forward(self, *, input_ids: torch.Tensor, attention_mask: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        m = attention_mask.unsqueeze(-1).float()  # (B, T, 1)
        return scale * (self.mlp(self.emb(input_ids)) * m).sum(1) / m.sum(1)


def _ids(batch: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    x = _tokenized(batch, seq, seed)
    return {"input_ids": x["input_ids"] % 100, "attention_mask": x["attention_mask"]}


@pytest.mark.parametrize("recipe", ["eager", "dynamic-int8"])
def test_keyword_only_forward_is_optimized_called_by_keyword_saved_and_loaded(recipe, fast_cfg, tmp_path):
    """Seen failing before the fix: ``optimize(model, {'input_ids': ..., 'attention_mask': ...})`` on a
    ``forward(self, *, input_ids, attention_mask)`` raised "forward takes [], so [...] cannot be passed. ... pass
    a tuple in forward's order", which no tuple can do."""
    model = _KeywordOnly().eval()
    cfg = fast_cfg(recipes=[] if recipe == "eager" else [recipe], finalists=1, min_speedup=0.0, cache=False)
    om = torchnitro.optimize(model, _ids(4, 12, 0), cfg)
    assert om.recipe == recipe, [(c.recipe, c.status, c.reason) for c in om.report.candidates]
    assert om.report.model == "_KeywordOnly"
    assert [i["name"] for i in om.signature["inputs"]] == ["input_ids", "attention_mask"]
    held = _ids(3, 7, 1)
    with torch.inference_mode():
        ref = model(**held)
    out = om(**held)
    torch.testing.assert_close(out, ref, rtol=0.05, atol=0.05)
    # eager is saved as a standalone torch.export program (the adapter takes *inputs); dynamic-int8 rebuilds from
    # the user's own object, given to load as it is
    loaded = torchnitro.load(om.save(tmp_path / "a"), model=None if recipe == "eager" else model)
    torch.testing.assert_close(loaded(**held), out)


def test_keyword_only_forward_missing_a_required_keyword_is_named():
    from torchnitro.errors import InputError

    with pytest.raises(InputError, match=r"requires \['attention_mask'\] by keyword"):
        torchnitro.optimize(_KeywordOnly(), {"input_ids": torch.zeros(2, 4, dtype=torch.long)})


class _Varargs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return self.lin(xs[0]) + xs[1]


def test_a_forward_taking_star_args_saves_eager_as_a_standalone_program(fast_cfg, tmp_path, recwarn):
    """A user's ``forward(self, *xs)`` chosen eager was saved with "torch.export failed (UserError: Detected mismatch
    between the structure of `inputs` and `dynamic_shapes`)" and needed the model object to load (seen failing)."""
    model = _Varargs().eval()
    x = (torch.randn(4, 8), torch.randn(4, 8))
    om = torchnitro.optimize(model, x, fast_cfg(recipes=[], cache=False))
    loaded = torchnitro.load(om.save(tmp_path / "a"))  # no model: the artifact holds the program
    assert not [w for w in recwarn if "torch.export failed" in str(w.message)]
    y = (torch.randn(2, 8), torch.randn(2, 8))
    torch.testing.assert_close(loaded(*y), model(*y))


_SCRIPT = """
import torch
from torch import nn


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 16)
        self.out = nn.Linear(16, 5)

    def forward(self, ids, mask):
        return self.out(self.emb(ids)) * mask.unsqueeze(-1)


def build():
    torch.manual_seed(0)
    mask = torch.ones(4, 12, dtype=torch.long)
    mask[:2, 8:] = 0
    return Tagger().eval(), (torch.randint(1, 100, (4, 12)) * mask, mask)
"""


def test_a_script_factory_with_a_mask_gets_a_variant_that_takes_another_length(tmp_path, fast_cfg):
    """``torchnitro optimize --model script.py:build`` (the factory returns (model, (ids, mask))): the artifact's
    ONNX variant failed on a batch of another length ("Got: 7 Expected: 12", seen on the old code)."""
    script = tmp_path / "user_script.py"
    script.write_text(_SCRIPT)
    om = torchnitro.optimize(f"{script}:build", None, fast_cfg(recipes=_onnx_recipe(), finalists=1, min_speedup=0.0,
                                                                cache=False))
    assert om.recipe == "onnxruntime", [(c.recipe, c.status, c.reason) for c in om.report.candidates]
    loaded = torchnitro.load(om.save(tmp_path / "a"))
    ids, mask = torch.randint(1, 100, (3, 7)), torch.ones(3, 7, dtype=torch.long)
    assert loaded(ids, mask).shape == (3, 7, 5)


def test_torchscript_traces_a_sentence_transformer_by_its_flat_tensors(tmp_path, fast_cfg):
    """sentence-transformers 6 puts ``'modality': 'text'`` in its feature dict, and the trace refused the dict
    ("Tracer cannot infer type of ({'input_ids': tensor(...), ..., 'modality': 'text', ...})", seen failing): the
    recipe now traces the flat tensors as the ONNX export does, and the artifact loads and answers alike."""
    model = _tiny_sentence_transformer(tmp_path / "st")
    feats = model.preprocess(["the cat sat on the mat", "a quick brown fox jumps over the lazy dog", "hello"])
    om = torchnitro.optimize(model, feats, fast_cfg(recipes=["torchscript"], finalists=1, min_speedup=0.0,
                                                    cache=False))
    assert om.recipe == "torchscript", [(c.recipe, c.status, c.reason) for c in om.report.candidates]
    held = model.preprocess(["what is the weather in paris today", "x"])
    with torch.inference_mode():
        ref = model(dict(held))["sentence_embedding"]
    loaded = torchnitro.load(om.save(tmp_path / "a"), trust_code=True)  # standalone: no model object
    for fn in (om, loaded):
        out = fn(dict(held))["sentence_embedding"]
        assert float(torch.nn.functional.cosine_similarity(out, ref).min()) > 0.9999


def test_a_time_limit_an_exporter_wraps_is_a_budget_skip_not_a_failure(tmp_path, monkeypatch):
    """The coverage run's XLM-R had onnxruntime 'failed' with "ONNX export failed: ... dynamo exporter:
    ConversionError: Failed to decompose the FX graph" at the search's budget: torch.onnx wrapped the
    CandidateTimeout the search's timer raised, and the program's preparation took it for the model's error."""
    import torchnitro.autotune.program as program
    from torchnitro.autotune.limits import CandidateTimeout, timed_out

    def wrapped(*args, **kwargs):
        try:
            raise CandidateTimeout("ran past its 3 s limit")
        except CandidateTimeout as exc:
            raise RuntimeError("Failed to decompose the FX graph for ONNX compatibility") from exc

    monkeypatch.setattr(program, "prepare_program", wrapped)
    progs = program.Programs(nn.Linear(2, 2), (torch.ones(1, 2),), {0: [0]}, tmp_path)
    out, _ = progs.get("onnx", limit_s=60.0, remaining_s=3.0)  # the budget's 3 s, under the recipe's limit
    assert out.budget and out.reason.startswith("budget: preparing the onnx program"), out.reason
    out, _ = program.Programs(nn.Linear(2, 2), (torch.ones(1, 2),), {0: [0]}, tmp_path).get("onnx", 3.0, 60.0)
    assert not out.budget and "ran past its 3 s limit" in out.reason, out.reason
    assert timed_out(ValueError("x")) is None


def test_onnx_export_does_not_start_the_second_exporter_after_the_time_limit(tmp_path, monkeypatch):
    from torchnitro.autotune.limits import CandidateTimeout, timed_out
    from torchnitro.autotune.recipes import onnx

    calls = []

    def export(*args, dynamo=False, **kwargs):
        calls.append(dynamo)
        raise CandidateTimeout("ran past its 3 s limit")

    monkeypatch.setattr(torch.onnx, "export", export)
    with pytest.raises(Exception) as info:
        onnx.export_onnx(nn.Linear(2, 2), (torch.ones(1, 2),), tmp_path / "m.onnx", {0: [0]})
    assert timed_out(info.value) is not None and calls == [False]


class _FixedLength(nn.Module):
    """Runs at the example's length only, as an ONNX graph whose reshape was traced with it does."""

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] != 16:
            raise RuntimeError("Non-zero status code returned while running Reshape node")
        return (ids * mask).float().unsqueeze(-1).repeat(1, 1, 4)


def test_a_variant_that_fails_at_another_size_is_named_so():
    """A script's nn.TransformerEncoder under onnxruntime failed the gate with only ORT's "Non-zero status code
    returned while running Reshape node '/enc/layers.0/self_attn/Reshape_4'": the reason now says it ran at the
    example's size and failed at the held-out set of another size."""
    from torchnitro.autotune.limits import CandidateTimeout
    from torchnitro.autotune.verify import collect

    x, half = _ids(4, 16, 0), _ids(2, 8, 1)
    sets = [(x["input_ids"], x["attention_mask"]), (half["input_ids"], half["attention_mask"])]
    with pytest.raises(RuntimeError, match=r"another size \(2x8, 2x8\) after running at 4x16, 4x16.*Reshape node"):
        collect(_FixedLength(), sets)
    assert len(collect(_FixedLength(), sets[:1])) == 1

    def late(*xs):
        if xs[0].shape[0] == 2:
            raise CandidateTimeout("ran past its 3 s limit")
        return xs[0]

    with pytest.raises(CandidateTimeout):  # the time limit stays the time limit
        collect(late, sets)


class _Encoder(nn.Module):
    """A script's own encoder on nn.TransformerEncoder (its attention reshapes by the traced length)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(100, 16)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 1)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.enc(self.emb(ids), src_key_padding_mask=mask == 0)


def test_onnx_export_whose_trace_fixed_the_length_goes_to_the_dynamo_exporter(tmp_path):
    """The TorchScript-based exporter traced nn.MultiheadAttention's reshape with the example's length: the graph
    failed at another one ("Non-zero status code returned while running Reshape node", seen on the old code). A
    graph that comes out different one token shorter is exported by the dynamo exporter; one that does not (an HF
    classifier) keeps the fast exporter."""
    ort = pytest.importorskip("onnxruntime")
    from torchnitro.autotune.recipes.onnx import export_onnx

    x, other = _ids(4, 12, 0), _ids(3, 7, 1)
    dims = {0: [0, 1], 1: [0, 1]}
    model = _Encoder().eval()
    meta = export_onnx(model, (x["input_ids"], x["attention_mask"]), tmp_path / "enc.onnx", dims)
    assert meta["exporter"] == "dynamo", meta
    sess = ort.InferenceSession(str(tmp_path / "enc.onnx"), providers=["CPUExecutionProvider"])
    out = sess.run(None, {"input_0": other["input_ids"].numpy(), "input_1": other["attention_mask"].numpy()})[0]
    real = other["attention_mask"].bool()
    with torch.no_grad():
        ref = model(other["input_ids"], other["attention_mask"])
    torch.testing.assert_close(torch.from_numpy(out)[real], ref[real], rtol=1e-4, atol=1e-4)
    t = _tokenized(4, 12, 0)
    meta = export_onnx(_classifier(), (t["input_ids"], t["attention_mask"], t["token_type_ids"]), tmp_path / "c.onnx",
                       {0: [0, 1], 1: [0, 1], 2: [0, 1]})
    assert meta["exporter"] == "torchscript", meta
    assert not list(tmp_path.glob("*_shorter.onnx"))
