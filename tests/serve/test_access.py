"""The shared admission checks: token, lookup, accepting; every front end answers from these."""

from __future__ import annotations

from types import SimpleNamespace

from torchnitro.serve.access import UNAUTHORIZED, Refusal, bearer, find_model, not_accepting, token_ok


def test_token_is_compared_exactly_and_only_when_configured():
    assert bearer(None) is None and bearer("") is None and token_ok(None, None)
    want = bearer("s3cret")
    assert want == b"Bearer s3cret"
    assert token_ok(want, b"Bearer s3cret") and token_ok(want, "Bearer s3cret")
    assert not token_ok(want, None) and not token_ok(want, b"Bearer s3cre") and not token_ok(want, "s3cret")
    assert UNAUTHORIZED.status == 401 and "Bearer <token>" in UNAUTHORIZED.message


def test_unknown_model_lists_the_served_ones():
    ep = object()
    assert find_model({"b": ep}, "b") is ep
    r = find_model({"b": ep, "a": ep}, "nope")
    assert r == Refusal(404, "unknown model 'nope'; this server serves ['a', 'b']")


def test_draining_unloaded_or_unstarted_is_503():
    up = SimpleNamespace(ready=True, batcher=object())
    assert not_accepting(False, up) is None
    for draining, ep in [(True, up), (False, SimpleNamespace(ready=False, batcher=object())),
                         (False, SimpleNamespace(ready=True, batcher=None))]:
        r = not_accepting(draining, ep)
        assert r is not None and r.status == 503 and "draining or not ready" in r.message
