"""What a quantization point is, as values: number formats (`formats`), how
each format family computes and calls (`format_kinds`), block granularity
(`granularity`), schemes and formulations (`schemes`), qparams from a range
(`qparams`) and the point's specification (`qspec`, a pure value type).

The public names are re-exported by `pt2e_fq`; this face imports nothing, so
that a low module (observers, ops) can import `spec.formats` without pulling
in `spec.qspec`, which sits above the observers.
"""
