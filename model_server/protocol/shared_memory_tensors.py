"""Tensors by region: inputs and requested outputs whose parameters name a registered system
shared-memory region (Triton's ``shared_memory_region``, ``shared_memory_byte_size``,
``shared_memory_offset``) are read from it or written into it instead of the message.

``SystemSharedMemory.attach`` checks a request's references before it is prepared: the caller
may use shared memory, every region exists and covers the range, and an input's byte size is
its shape x datatype. The request the scheduler then sees is the same request with each
region's bytes as that input's raw contents, read from the object once (a read-only copy: the
client may change or shrink the object while the model runs, and neither reaches it). After
the model ran, ``Attachment.write_outputs`` copies each output into its region and leaves its
entry in ``raw_output_contents`` empty (Triton's layout, so ``InferResult`` stays aligned);
the output keeps its name, datatype and shape.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from tritonclient.grpc import service_pb2

from model_server.core.datatypes import DATATYPES
from model_server.core.errors import InferenceError, InvalidInput
from model_server.core.validation import whole_number
from model_server.protocol.shared_memory import Region, SharedMemoryRegistry
from model_server.security.access import Restriction, check_metadata

log = logging.getLogger(__name__)

REGION = "shared_memory_region"
BYTE_SIZE = "shared_memory_byte_size"
OFFSET = "shared_memory_offset"
GROUP = "shared-memory"
_ALL = (REGION, BYTE_SIZE, OFFSET)


@dataclass(frozen=True, slots=True)
class TensorRef:
    """Where one tensor lives: ``byte_size`` bytes at ``offset`` into region ``region``."""

    region: str
    offset: int
    byte_size: int


def names_shared_memory(request: service_pb2.ModelInferRequest) -> bool:
    """Whether any input or requested output carries a shared-memory parameter (the hot
    path's only cost when none does)."""
    for tensors in (request.inputs, request.outputs):  # no tuple of both built per request
        for tensor in tensors:
            parameters = tensor.parameters
            if parameters and any(name in parameters for name in _ALL):
                return True
    return False


def tensor_ref(parameters: Mapping[str, Any], where: str) -> TensorRef | None:
    """The reference in a tensor's parameters, checked; None when it names no region."""
    if REGION not in parameters:
        stray = [name for name in (BYTE_SIZE, OFFSET) if name in parameters]
        if stray:
            raise InvalidInput(f"{where}: parameters {stray} given without {REGION!r}")
        return None
    region = parameters[REGION]
    if region.WhichOneof("parameter_choice") != "string_param" or not region.string_param:
        raise InvalidInput(f"{where}: parameters[{REGION!r}]: expected a region name (a string)")
    if BYTE_SIZE not in parameters:
        raise InvalidInput(f"{where}: parameters[{BYTE_SIZE!r}] is required with {REGION!r}")
    size = whole_number(parameters[BYTE_SIZE], f"{where}: parameters[{BYTE_SIZE!r}]")
    offset = 0
    if OFFSET in parameters:
        offset = whole_number(parameters[OFFSET], f"{where}: parameters[{OFFSET!r}]")
    return TensorRef(region.string_param, offset, size)


class RegionRequest:
    """A ModelInferRequest whose raw_input_contents are given here (what was read from regions
    and the message's own contents, one per input in order); everything else is the request's."""

    __slots__ = ("_request", "raw_input_contents")

    def __init__(self, request: service_pb2.ModelInferRequest, raw: list[Any]) -> None:
        self._request = request
        self.raw_input_contents = raw

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


@dataclass(frozen=True)
class Attachment:
    """One request's regions: the request to prepare, and where its outputs go."""

    request: Any  # a RegionRequest when an input is in a region, else the request itself
    outputs: Mapping[str, tuple[Region, int, int]]  # output -> (region, start, end)
    release: Callable[[], None]  # the output regions stay open until this is called

    def write_outputs(self, response: service_pb2.ModelInferResponse) -> None:
        for index, output in enumerate(response.outputs):
            target = self.outputs.get(output.name)
            if target is None:
                continue
            region, start, end = target
            data = response.raw_output_contents[index]
            if len(data) > end - start:
                raise InvalidInput(
                    f"output {output.name!r}: {len(data)} bytes (shape {list(output.shape)}) do "
                    f"not fit its {BYTE_SIZE} of {end - start} in region "
                    f"{region.status.name!r}"
                )
            region.write(start, data)
            response.raw_output_contents[index] = b""
            output.parameters[REGION].string_param = region.status.name
            output.parameters[BYTE_SIZE].int64_param = len(data)


class SystemSharedMemory:
    """The server's system shared memory: its regions and who may use them.

    It is on only when the ``shared-memory`` API group is restricted (``--restricted-api
    shared-memory:HEADER=@FILE``): a region gives its user the server's access to a file on
    this host, so an open server would let anyone who reaches its port read and write every
    shared-memory object its user can. A request that names a region must carry the group's
    credential too (the inference group does not need it)."""

    def __init__(self, restriction: Restriction | None, registry: SharedMemoryRegistry) -> None:
        self.restriction = restriction
        self.registry = registry

    @classmethod
    def of(cls, restrictions: Mapping[str, Restriction]) -> SystemSharedMemory:
        """The server's, from its ``--restricted-api`` table: on when the group is in it."""
        restriction = restrictions.get(GROUP)
        if restriction is not None:
            log.info("system shared memory on, for callers with header %r", restriction.header)
        return cls(restriction, SharedMemoryRegistry())

    @property
    def enabled(self) -> bool:
        return self.restriction is not None

    def check_enabled(self) -> None:
        if self.restriction is None:
            raise InferenceError(
                "system shared memory is off on this server: it is on only when the "
                "shared-memory API group is restricted (--restricted-api "
                "shared-memory:HEADER=@FILE), and then for callers with that credential",
                grpc.StatusCode.PERMISSION_DENIED,
            )

    def check_caller(self, metadata: Sequence[tuple[str, Any]]) -> None:
        self.check_enabled()
        assert self.restriction is not None
        refused = check_metadata({GROUP: self.restriction}, GROUP, metadata)
        if refused is not None:
            raise InferenceError(
                f"a request that names a shared memory region: {refused}",
                grpc.StatusCode.PERMISSION_DENIED,
            )

    def attach(
        self, request: service_pb2.ModelInferRequest, metadata: Sequence[tuple[str, Any]]
    ) -> Attachment:
        """The request's regions resolved and checked (InferenceError naming the field)."""
        self.check_caller(metadata)
        model = f"model {request.model_name!r}"
        raw = self._inputs(request, model)
        regions: list[Region] = []
        outputs: dict[str, tuple[Region, int, int]] = {}
        for output in request.outputs:
            where = f"{model} output {output.name!r}"
            ref = tensor_ref(output.parameters, where)
            if ref is not None:
                region = self.registry.get(ref.region, where)
                outputs[output.name] = (region, *region.span(ref.offset, ref.byte_size, where))
                regions.append(region)
        prepared = request if raw is None else RegionRequest(request, raw)
        return Attachment(prepared, outputs, self.registry.hold(regions))

    def _inputs(self, request: service_pb2.ModelInferRequest, model: str) -> list[Any] | None:
        """Every input's raw contents, regions' read from them; None when no input is in one."""
        given = iter(request.raw_input_contents)
        raw: list[Any] = []
        in_regions = 0
        for tensor in request.inputs:
            where = f"{model} input {tensor.name!r}"
            ref = tensor_ref(tensor.parameters, where)
            if ref is None:
                raw.append(next(given, None))
                continue
            _check_byte_size(tensor, ref, where)
            region = self.registry.get(ref.region, where)
            raw.append(region.read(*region.span(ref.offset, ref.byte_size, where)))
            in_regions += 1
        if not in_regions:
            return None
        if None in raw or next(given, None) is not None:
            raise InvalidInput(
                f"{model}: raw_input_contents has {len(request.raw_input_contents)} entries for "
                f"{len(request.inputs) - in_regions} inputs outside shared memory; send raw "
                "contents for each of them"
            )
        return raw


def _check_byte_size(
    tensor: service_pb2.ModelInferRequest.InferInputTensor, ref: TensorRef, where: str
) -> None:
    datatype = DATATYPES.get(tensor.datatype)
    shape = list(tensor.shape)
    if datatype is None or datatype.is_bytes or any(d < 0 for d in shape):
        return  # the tensor's own checks name these; BYTES sizes are their contents'
    expected = math.prod(shape) * datatype.itemsize
    if ref.byte_size != expected:
        raise InvalidInput(
            f"{where}: parameters[{BYTE_SIZE!r}] is {ref.byte_size}, expected {expected} "
            f"(shape {shape} x {datatype.itemsize} bytes of {datatype.name})"
        )
