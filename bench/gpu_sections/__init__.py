"""bench/gpu.py's parts, by concern (``bench/gpu.py`` itself keeps the command line and ``main``).

* ``plumbing``: the import root (``ensure_jitney_importable``), the budget, the run's record
  (``Run``), ``log``, the device's dtype, the workloads, environment helpers;
* ``checkpoints``: the model ``SHAPES``, the tokenizer and the random-weight checkpoints;
* ``offline``: offline-64 on `jitney serve` + `jitney bench` (the step traces);
* ``measure``: a worker ``ModelRunner`` driven with engine plans, one decode or prefill step timed;
* ``steps``: the decode and prefill sections; ``profiles``: their torch.profiler and cProfile tables;
* ``invariance``: ``--batch-invariant`` off and on: the experiment and its cost;
* ``hf``: transformers' continuous batching on the same requests;
* ``tables`` and ``report``: the markdown report.
"""
