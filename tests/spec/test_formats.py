"""The element table against torch's own description of each dtype, and the
public ops naming an element by string as well as by torch dtype."""

from __future__ import annotations

import math

import pytest
import torch

import pt2e_fq as q
from pt2e_fq.spec.formats import ELEMENTS

FP8 = [e for e in ELEMENTS.values() if e.torch_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]


@pytest.mark.parametrize("elem", FP8, ids=lambda e: e.name)
def test_fp8_facts_are_torchs(elem):
    info = torch.finfo(elem.torch_dtype)
    assert (elem.fmax, elem.bits) == (info.max, info.bits)
    assert elem.emax == math.floor(math.log2(info.max))


def test_e2m1_facts_by_hand():
    # E2M1: 1 sign, 2 exponent (bias 1), 1 mantissa bit; largest 1.1b x 2^2 = 6.
    e = ELEMENTS["e2m1"]
    assert (e.fmax, e.emax, e.bits, e.torch_dtype) == (6.0, 2, 4, torch.float4_e2m1fn_x2)


def test_every_float_format_derives_its_element_from_the_table():
    for fmt in q.FloatFormat:
        assert fmt.element is ELEMENTS[fmt.element.name]
        assert (fmt.fmax, fmt.torch_dtype, fmt.bits) == (fmt.element.fmax, fmt.element.torch_dtype, fmt.element.bits)
    assert (q.MXFP4.scale_block, q.NVFP4.scale_block) == (32, 16)  # OCP MX v1.0; NVIDIA NVFP4


@pytest.mark.parametrize("elem", ELEMENTS.values(), ids=lambda e: e.name)
def test_the_ops_take_an_element_by_name_or_by_dtype(elem):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    scale = torch.full((4, 1), 0.01)
    by_name = q.fake_quantize_float(x, [1, 64], scale, elem.name)
    by_dtype = q.fake_quantize_float(x, [1, 64], scale, elem.torch_dtype)
    assert torch.equal(by_name, by_dtype)
    assert torch.equal(q.fake_quantize_mx(x, elem.name), q.fake_quantize_mx(x, elem.torch_dtype))


@pytest.mark.parametrize("bad, error, text", [
    ("e3m2", ValueError, "must be one of 'e4m3' / torch.float8_e4m3fn"),
    (torch.float16, ValueError, "got torch.float16"),
    (8, TypeError, "an element name or a torch.dtype"),
])
def test_an_unknown_element_names_the_allowed_ones(bad, error, text):
    with pytest.raises(error, match=text.replace(".", r"\.").replace("(", r"\(")):
        q.fake_quantize_float(torch.randn(4), [4], torch.ones(1), bad)
