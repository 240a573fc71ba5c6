"""Calls the demo classifier with the stock Triton client: ``python examples/classify.py``."""

from __future__ import annotations

import argparse

import numpy as np
import tritonclient.grpc as grpcclient


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", default="127.0.0.1:8001")
    parser.add_argument("--model", default="classifier")
    parser.add_argument("--version", default="", help="empty: the newest READY version")
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()

    client = grpcclient.InferenceServerClient(args.url)
    print("server ready:", client.is_server_ready())
    # The repository index is for operators (`infermesh models index`): Envoy's listener
    # serves inference, metadata and health only.
    metadata = client.get_model_metadata(args.model, args.version)
    print(f"  {metadata.name} versions {list(metadata.versions)}: inputs "
          f"{[(i.name, i.datatype, list(i.shape)) for i in metadata.inputs]}")  # fmt: skip
    images = np.random.default_rng(0).random((args.batch, 3, 32, 32), dtype=np.float32)
    tensor = grpcclient.InferInput("input", list(images.shape), "FP32")
    tensor.set_data_from_numpy(images)
    result = client.infer(args.model, [tensor], model_version=args.version, request_id="example-1")
    probs = result.as_numpy("probs")
    response = result.get_response()
    print(f"{response.model_name} v{response.model_version} answered request {response.id!r}")
    for row, p in enumerate(probs):
        print(f"  image {row}: class {int(p.argmax())} (p={float(p.max()):.3f})")


if __name__ == "__main__":
    main()
