"""The application layer: the `pt2e-fq` command (`command`), the PT2E flow
in a few calls (`pipeline`), the demo with its data (`demo`, `digits`) and
the step-timing helper the demo's table uses (`step_time`).

It is the only part of pt2e_fq that imports `quantizers`: the runtime (ops,
FakeQuantize, observers, export, report) works with any Quantizer.
"""
