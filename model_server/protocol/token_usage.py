"""What a text generation reports to the edge's token limits: ``x-infermesh-tokens-used``.

Envoy settles each request's token reservation with this value (a gRPC trailer, a REST
header; ``control_plane.xds.token_admission``): the prompt's tokens plus those generated, or 0
for a refusal that came before any work. A request that is not a text generation reports
nothing, and neither does an error after work began (the reservation stays charged).

The front ends of ``--frontends N`` report it too, from the request they forward and the
answer they relay, so this module imports nothing that loads a model.
"""

from __future__ import annotations

import grpc
from tritonclient.grpc import service_pb2

from infermesh.wire import TOKENS_USED_HEADER
from model_server.generative.text import completion_tokens

# Refusals that come before any token is computed (their token reservation is refunded).
REFUSED_BEFORE_WORK = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAVAILABLE,
    }
)


def usage_trailer(
    prompt: int | None,
    response: service_pb2.ModelInferResponse | None = None,
    refused: grpc.StatusCode | None = None,
) -> tuple[tuple[str, str], ...]:
    """The trailer for a ModelInfer whose prompt took ``prompt`` tokens (None: not a text
    generation): answered with ``response``, or refused with the status ``refused``."""
    if prompt is None:
        return ()
    if response is not None:
        return ((TOKENS_USED_HEADER, str(prompt + completion_tokens([response]))),)
    if refused in REFUSED_BEFORE_WORK:
        return ((TOKENS_USED_HEADER, "0"),)
    return ()
