"""The gRPC door of the scheduler process: its server, with the generation
service, ``grpc.health.v1`` and server reflection, and the health it reports.

``scheduler/main.py`` builds it (``grpc_server``), binds it (``listen_grpc``,
scheduler/security/tls.py) and sets its health (``set_health``) as the
worker comes and goes.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jitney.v1 import generation_pb2 as pb
from jitney.v1 import generation_pb2_grpc as pb_grpc
from jitney.scheduler.api.metrics import request_log
from jitney.scheduler.api.servicer import GenerationServicer
from jitney.scheduler.security.keys import ApiKeyInterceptor
from jitney.scheduler.security.tls import ServerSecurity

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def grpc_server(servicer: GenerationServicer, health_servicer: health.aio.HealthServicer,
                security: ServerSecurity) -> grpc.aio.Server:
    """The gRPC server with its three services; with API keys, their interceptor."""
    interceptors = []
    if security.keys is not None:
        def refused(method: str, peer: str, why: str) -> None:
            servicer.metrics.failure("UNAUTHENTICATED")
            request_log.info("call %s from %s: rejected UNAUTHENTICATED (%s)", method, peer, why)

        interceptors.append(ApiKeyInterceptor(security.keys, refused))
    server = grpc.aio.server(interceptors=interceptors, options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),   # a second server on this port fails its bind (jitney.common.ports)
    ])
    pb_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return server


async def set_health(servicer: health.aio.HealthServicer, status: int) -> None:
    """``status`` for the server as a whole ("") and for the generation service."""
    await servicer.set("", status)
    await servicer.set(SERVICE_NAME, status)
