"""Calls the demo classifier with the stock Triton client: ``python examples/classify.py``.

Through Envoy it sends the local mesh's API key (``.infermesh/api.key``, made by ``infermesh
up``; ``INFERMESH_API_KEY`` or ``INFERMESH_API_KEY_FILE`` choose another) as HTTP Basic. With
``--ca FILE`` it speaks TLS to a listener with ``listener.tls``, trusting that CA."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from infermesh.api_keys import client_headers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", default="127.0.0.1:8001")
    parser.add_argument("--model", default="classifier")
    parser.add_argument("--version", default="", help="empty: the newest READY version")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument(
        "--ca", default="", help="TLS to the edge (listener.tls), trusting this CA file"
    )
    args = parser.parse_args()

    tls = {"ssl": True, "root_certificates": args.ca} if args.ca else {}
    client = grpcclient.InferenceServerClient(args.url, **tls)
    headers = client_headers(Path(__file__).resolve().parent.parent)
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
