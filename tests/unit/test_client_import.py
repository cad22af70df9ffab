"""``loraplex.server.client`` is usable without torch: the client, its dataclasses and the
wire conversions import no engine module (a client machine needs grpcio and protobuf only)."""

from __future__ import annotations

import subprocess
import sys

# Any import of torch (or transformers) fails; then the client is imported and used.
SCRIPT = r"""
import sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "safetensors"):
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, NoTorch())

from loraplex.server import client
from loraplex.server.wire.messages import generate_request_from_pb, generate_request_to_pb

request = client._request(None, "my-lora", None, "", {"max_tokens": 3},
                          messages=[{"role": "user", "content": "Hi"}])
assert generate_request_from_pb(generate_request_to_pb(request)) == request
with client.Client("127.0.0.1:1", api_key="k") as c:
    assert c.has_api_key
engine = sorted(m for m in sys.modules if m.startswith("loraplex.server.engine")
                or m.startswith("loraplex.kernels") or m.split(".")[0] in ("torch", "numpy"))
print("loaded:", engine)
"""


def test_client_imports_without_torch_or_the_engine() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "loaded: []"
