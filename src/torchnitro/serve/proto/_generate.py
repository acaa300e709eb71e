"""Regenerate ``grpc_predict_v2_pb2.py`` from ``grpc_predict_v2.proto`` (needs grpcio-tools).

    python -m torchnitro.serve.proto._generate

Two edits follow protoc, both so the module sits beside other v2 clients in one process:

* the messages live in a private descriptor pool: Triton's ``tritonclient.grpc`` registers the same
  ``inference.*`` names in the default pool, and two files defining one name there cannot both load;
  the wire format does not depend on the pool;
* the gencode/runtime version pin is dropped: the module only uses ``builder``, which protobuf 5, 6
  and 7 share, and tritonclient pins protobuf 6 while other packages bring 7.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

__all__ = ["generate"]

HERE = Path(__file__).resolve().parent


def generate() -> Path:
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{HERE}", f"--python_out={HERE}",
                    str(HERE / "grpc_predict_v2.proto")], check=True)
    out = HERE / "grpc_predict_v2_pb2.py"
    text = out.read_text()
    start = text.index("_runtime_version.ValidateProtobufRuntimeVersion(")
    text = text[:start] + text[text.index(")\n", start) + 2:]
    text = text.replace("from google.protobuf import runtime_version as _runtime_version\n", "")
    text = text.replace("DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile(",
                        "POOL = _descriptor_pool.DescriptorPool()  # private: see torchnitro.serve.proto._generate\n"
                        "DESCRIPTOR = POOL.AddSerializedFile(")
    text = text.replace("# NO CHECKED-IN PROTOBUF GENCODE\n", "# Checked in on purpose; regenerate with "
                        "python -m torchnitro.serve.proto._generate\n")
    text += "__all__ = ['DESCRIPTOR', 'POOL', *DESCRIPTOR.message_types_by_name]\n"
    out.write_text(text)
    return out


if __name__ == "__main__":  # the command line: say where the module was written
    sys.stdout.write(f"{generate()}\n")
