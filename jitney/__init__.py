"""Jitney: an LLM inference server built around in-flight (continuous) batching.

One import root. Its parts, and which may import which (``docs/architecture.md``;
``tests/test_import_rules.py`` enforces it):

    jitney.v1          public gRPC stubs (generated from protos/jitney/v1)
    jitney.engine.v1   internal scheduler <-> worker contract (generated)
    jitney.common      what both processes need (model files)
    jitney.client      the typed client, `jitney generate/health/bench`; imports jitney.v1 only
    jitney.scheduler   the scheduler process; never imports jitney.worker or torch in its scheduling code
    jitney.worker      the worker process; never imports jitney.scheduler
    jitney.cli         the `jitney` command: dispatches lazily to the parts above
"""

__version__ = "0.1.0"
