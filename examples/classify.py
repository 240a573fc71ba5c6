"""Calls the demo classifier with the stock Triton client: ``python examples/classify.py``.

Through Envoy it sends the local mesh's API key (``.infermesh/api.key``, made by ``infermesh
up``; ``INFERMESH_API_KEY`` or ``INFERMESH_API_KEY_FILE`` choose another) as HTTP Basic, over
TLS to the edge (``listener.tls``), trusting the local mesh's CA (``.infermesh/pki/ca.crt``,
where ``infermesh up`` keeps the edge's certificate) or ``--ca FILE``; ``--plaintext`` for a
listener without TLS."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from infermesh.api_keys import client_headers

ROOT = Path(__file__).resolve().parent.parent
LOCAL_CA = ROOT / ".infermesh" / "pki" / "ca.crt"  # infermesh up's mesh CA: it signs the edge


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", default="127.0.0.1:8080", help="Envoy's listener")
    parser.add_argument("--model", default="classifier")
    parser.add_argument("--version", default="", help="empty: the newest READY version")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument(
        "--ca", default=str(LOCAL_CA), help="TLS to the edge, trusting this CA file (default: "
        "the local mesh's)",
    )  # fmt: skip
    parser.add_argument("--plaintext", action="store_true", help="a listener without TLS")
    args = parser.parse_args()

    tls = {} if args.plaintext else {"ssl": True, "root_certificates": args.ca}
    if not args.plaintext and not Path(args.ca).is_file():
        parser.error(f"--ca {args.ca}: no such file (start the mesh: make run; or --plaintext)")
    client = grpcclient.InferenceServerClient(args.url, **tls)
    headers = client_headers(ROOT)
    print("server ready:", client.is_server_ready(headers=headers))
    # The repository index is for operators (`infermesh models index`): Envoy's listener
    # serves inference, metadata and health only.
    metadata = client.get_model_metadata(args.model, args.version, headers=headers)
    print(f"  {metadata.name} versions {list(metadata.versions)}: inputs "
          f"{[(i.name, i.datatype, list(i.shape)) for i in metadata.inputs]}")  # fmt: skip
    images = np.random.default_rng(0).random((args.batch, 3, 32, 32), dtype=np.float32)
    tensor = grpcclient.InferInput("input", list(images.shape), "FP32")
    tensor.set_data_from_numpy(images)
    result = client.infer(
        args.model, [tensor], model_version=args.version, request_id="example-1", headers=headers
    )
    probs = result.as_numpy("probs")
    response = result.get_response()
    print(f"{response.model_name} v{response.model_version} answered request {response.id!r}")
    for row, p in enumerate(probs):
        print(f"  image {row}: class {int(p.argmax())} (p={float(p.max()):.3f})")


if __name__ == "__main__":
    main()
