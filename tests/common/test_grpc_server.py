"""ServiceServer serves health checking and reflection for the services it hosts."""
import grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common.grpc_server import ServiceServer, channel, check_health
from services.common.proto.rlyard.v1 import rollout_pb2_grpc


class _Rollout(rollout_pb2_grpc.RolloutServicer):
    pass  # unimplemented methods answer UNIMPLEMENTED; enough to register the service


async def test_health_and_reflection():
    server = ServiceServer("127.0.0.1", 0)
    server.add(rollout_pb2_grpc.add_RolloutServicer_to_server, _Rollout(), "rlyard.v1.Rollout")
    port = await server.start()
    target = f"127.0.0.1:{port}"
    try:
        assert await check_health(target)
        assert await check_health(target, "rlyard.v1.Rollout")
        assert not await check_health(target, "rlyard.v1.NoSuchService")
        async with channel(target) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            names = set()
            async for reply in replies:
                names |= {s.name for s in reply.list_services_response.service}
        assert {"rlyard.v1.Rollout", "grpc.health.v1.Health"} <= names
    finally:
        await server.stop(0)
    assert not await check_health(target, timeout=0.5)
