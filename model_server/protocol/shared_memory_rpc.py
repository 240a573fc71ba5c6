"""The shared-memory RPCs of GRPCInferenceService (Triton's grpc_service.proto): system shared
memory registered, listed and unregistered; CUDA shared memory answered UNIMPLEMENTED.

A mixin of ``InferenceService``, which sets ``shared_memory`` and ``device_label``; the API
group's credential (or an operator certificate) is checked before these run, by the server's
interceptor, like every restricted group's (``security.access``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from tritonclient.grpc import service_pb2

from model_server.core.errors import InferenceError
from model_server.protocol.shared_memory_tensors import SystemSharedMemory


class SharedMemoryRpcs:
    shared_memory: SystemSharedMemory
    device_label: str  # "cpu", "cuda:0"

    async def SystemSharedMemoryStatus(
        self, request: service_pb2.SystemSharedMemoryStatusRequest, context: Any
    ) -> object:
        def answer() -> object:
            response = service_pb2.SystemSharedMemoryStatusResponse()
            for region in self.shared_memory.registry.status(request.name):
                response.regions[region.name].CopyFrom(
                    service_pb2.SystemSharedMemoryStatusResponse.RegionStatus(
                        name=region.name,
                        key=region.key,
                        offset=region.offset,
                        byte_size=region.byte_size,
                    )
                )
            return response

        return await self._shared_memory_call(context, answer)

    async def SystemSharedMemoryRegister(
        self, request: service_pb2.SystemSharedMemoryRegisterRequest, context: Any
    ) -> object:
        def answer() -> object:
            self.shared_memory.registry.register(
                request.name, request.key, request.offset, request.byte_size
            )
            return service_pb2.SystemSharedMemoryRegisterResponse()

        return await self._shared_memory_call(context, answer)

    async def SystemSharedMemoryUnregister(
        self, request: service_pb2.SystemSharedMemoryUnregisterRequest, context: Any
    ) -> object:
        def answer() -> object:
            self.shared_memory.registry.unregister(request.name)
            return service_pb2.SystemSharedMemoryUnregisterResponse()

        return await self._shared_memory_call(context, answer)

    async def _shared_memory_call(self, context: Any, answer: Callable[[], object]) -> object:
        try:
            self.shared_memory.check_enabled()
            return answer()
        except InferenceError as exc:
            await context.abort(exc.code, exc.message)
        raise AssertionError("unreachable")

    async def CudaSharedMemoryStatus(self, request: object, context: Any) -> object:
        return await self._no_cuda(context)

    async def CudaSharedMemoryRegister(self, request: object, context: Any) -> object:
        return await self._no_cuda(context)

    async def CudaSharedMemoryUnregister(self, request: object, context: Any) -> object:
        return await self._no_cuda(context)

    async def _no_cuda(self, context: Any) -> object:
        if self.device_label == "cpu":
            message = "CUDA shared memory needs a GPU build; this server runs on cpu"
        else:
            message = (
                f"CUDA shared memory is not implemented by this server (it runs on "
                f"{self.device_label}); use system shared memory"
            )
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, message)
        raise AssertionError("unreachable")
