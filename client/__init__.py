"""Jitney's public client: the ``jitney.v1`` stubs and a small typed client.

    from jitney.client import JitneyClient, Sampling, TlsFiles, make_params, generation_pb2

This package imports the public API only (``jitney.v1``), never the
scheduler, the worker or the internal ``jitney.engine.v1`` contract.
"""

from jitney.client.channel import TlsFiles, open_aio_channel, open_channel
from jitney.client.client import FINISH_REASON_NAMES, JitneyClient, Sampling, make_params
from jitney.v1 import generation_pb2, generation_pb2_grpc

__all__ = ["FINISH_REASON_NAMES", "JitneyClient", "Sampling", "TlsFiles", "make_params", "open_aio_channel",
           "open_channel", "generation_pb2", "generation_pb2_grpc"]
