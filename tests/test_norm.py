"""RMSNorm family: fast == reference by the contract's rule on every dtype, layout, weight shape and thread count."""
import re
import sys

import numba
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fastattn
import fastattn.reference as ref
from fastattn._core import threads as _threads
from fastattn._core.kernel import KERNEL_OPTIONS
from fastattn._core.validate import FLOAT16, FLOAT32
from strategies import STORAGE_FLOATS
from fastattn.testing import assert_half_within_1ulp, assert_within_rule
from strategies import dims, eps_values, fill, float_dtypes, seeds, strided, thread_counts

OPS = ("rms_norm", "rms_norm_mul", "add_rms_norm_mul")
#: The rule's absolute floor for outputs up to 4 in magnitude (about four float32 roundings there). A row dominated
#: by one value normalises it to up to sqrt(D), times |w|: larger outputs scale the floor with them (``floor_for``).
FLOOR = 1e-6


def floor_for(reference):
    """The rule's floor for a result whose largest finite magnitude is that of ``reference``'s."""
    finite = np.abs(reference[np.isfinite(reference)])
    return FLOOR * max(1.0, float(finite.max(initial=0.0)) / 4.0)


def naive_f32(x, w, eps, residual=None):
    """The straightforward float32 NumPy evaluation the rule compares against."""
    s = x.astype(np.float32)
    if residual is not None:
        s = (s + residual.astype(np.float32)).astype(x.dtype).astype(np.float32)
    y = s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + np.float32(eps))
    if w is not None:
        w32 = w.astype(np.float32).reshape((1,) * (x.ndim - w.ndim) + w.shape)
        y = y * np.tile(w32, [n // m for n, m in zip(x.shape, w32.shape)])
    return y


def assert_close(fast, reference64, naive, what):
    if fast.dtype == FLOAT32:
        assert_within_rule(fast, reference64, naive, floor=floor_for(reference64), what=what)
    else:
        assert_half_within_1ulp(fast, reference64, what=what)


def call(op, module, x, w, eps, residual=None, **outs):
    if op == "rms_norm":
        return getattr(module, op)(x, eps, **outs)
    if op == "rms_norm_mul":
        return getattr(module, op)(x, w, eps, **outs)
    return getattr(module, op)(x, residual, w, eps, **outs)


@st.composite
def weight_shapes(draw, shape):
    """A shape that repeats to ``shape``: fewer or as many axes, each length a divisor (often all or 1)."""
    n_axes = draw(st.integers(1, len(shape)))
    out = []
    for n in shape[len(shape) - n_axes:]:
        divisors = [k for k in range(1, n + 1) if n % k == 0]
        out.append(draw(st.one_of(st.sampled_from((n, 1)), st.sampled_from(divisors))))
    if draw(st.booleans()):  # the common (..., D) weight
        out[-1] = shape[-1]
    return tuple(out)


@st.composite
def norm_cases(draw, max_rows=5, max_d=70):
    op = draw(st.sampled_from(OPS))
    dtype = draw(float_dtypes)
    shape = tuple(draw(st.lists(dims(1, max_rows), min_size=0, max_size=2))) + (draw(dims(1, max_d)),)
    x = draw(strided(shape, dtype, kind=draw(st.sampled_from(("normal", "mixed")))))
    residual = draw(strided(shape, dtype)) if op == "add_rms_norm_mul" else None
    w = None
    if op != "rms_norm":
        w = draw(strided(draw(weight_shapes(shape)), draw(float_dtypes), scale=2.0)).array
    # where the results go: new arrays, separate strided views, or in place
    choices = ("new", "views", "in_place") + (("swapped", "same") if op == "add_rms_norm_mul" else ())
    return op, x, residual, w, draw(eps_values), draw(st.sampled_from(choices))


def check_case(op, x, residual, w, eps, where, data):
    """Run fast and reference on identical copies and compare by the rule; check guard bands."""
    views = [v for v in (x, residual) if v is not None]
    reference_inputs = [v.array.copy() for v in views]
    ref_x, ref_res = reference_inputs[0], (reference_inputs[1] if residual is not None else None)
    expected = call(op, ref, ref_x, w, eps, ref_res, **_f64_outs(op, x.array.shape))
    expected_s, expected_y = expected if op == "add_rms_norm_mul" else (None, expected)
    naive = naive_f32(ref_x, w, eps, ref_res)

    outs, out_views = {}, []
    if where == "views":
        out_views = [data.draw(strided(x.array.shape, x.array.dtype))]
        if op == "add_rms_norm_mul":
            out_views.append(data.draw(strided(x.array.shape, x.array.dtype)))
            outs["sum_out"] = out_views[1].array
        outs["out"] = out_views[0].array
    elif where == "in_place":
        outs = {"out": x.array} if op != "add_rms_norm_mul" else {"sum_out": x.array, "out": residual.array}
    elif where == "swapped":
        outs = {"sum_out": residual.array, "out": x.array}
    elif where == "same":
        outs = {"sum_out": x.array, "out": x.array}
    result = call(op, fastattn, x.array, w, eps, residual.array if residual is not None else None, **outs)
    s, y = result if op == "add_rms_norm_mul" else (None, result)

    assert y.dtype == x.array.dtype and y.shape == x.array.shape
    if "out" in outs:
        assert y is outs["out"]
    if where == "same":
        assert s is y  # both are x, which ends up holding y
    assert_close(y, expected_y, naive, f"{op} y")
    if s is not None and where != "same":
        assert s.dtype == x.array.dtype
        assert s.tobytes() == expected_s.astype(x.array.dtype).tobytes(), "s is not bit-exact"
    for v in views + out_views:
        v.assert_outside_unchanged()


def _f64_outs(op, shape):
    """The reference writes unrounded float64 results into float64 outputs."""
    outs = {"out": np.empty(shape)}
    if op == "add_rms_norm_mul":
        outs["sum_out"] = np.empty(shape)
    return outs


@given(case=norm_cases(), threads=thread_counts, data=st.data())
def test_fast_matches_reference_on_views_dtypes_and_weights(case, threads, data):
    op, x, residual, w, eps, where = case
    with fastattn.num_threads(threads):
        check_case(op, x, residual, w, eps, where, data)


@given(op=st.sampled_from(OPS), dtype=st.sampled_from((FLOAT32, FLOAT16)), eps=eps_values, data=st.data())
def test_parallel_kernel_on_large_strided_views(op, dtype, eps, data):
    """> 1 MiB moved, so the prange kernels run: 2 threads against 1 thread bit for bit, and (into separate views
    or in place) against the reference by the rule."""
    shape = (data.draw(st.sampled_from((2, 3))), data.draw(dims(40, 67)), 4096 + data.draw(st.sampled_from((0, 3))))
    x = data.draw(strided(shape, dtype, contiguous_ok=data.draw(st.booleans())))
    residual = data.draw(strided(shape, dtype)) if op == "add_rms_norm_mul" else None
    w = fill(np.random.default_rng(data.draw(seeds)), shape[-1:], FLOAT32, scale=2.0)
    assert 2 * x.array.nbytes >= _threads.PARALLEL_MIN_BYTES
    with fastattn.num_threads(1):
        serial = call(op, fastattn, x.array, w, eps, residual.array if residual is not None else None)
    with fastattn.num_threads(2):
        parallel = call(op, fastattn, x.array, w, eps, residual.array if residual is not None else None)
        check_case(op, x, residual, w, eps, data.draw(st.sampled_from(("views", "in_place"))), data)
    for a, b in zip(serial if op == "add_rms_norm_mul" else [serial],
                    parallel if op == "add_rms_norm_mul" else [parallel]):
        assert a.tobytes() == b.tobytes()


def test_sum_of_squares_precision_at_16896_with_mixed_magnitudes():
    """Row length 16896 of values spanning 8 decades: the float64 sum of exact squares meets the rule."""
    rng = np.random.default_rng(1)
    x = fill(rng, (8, 16896), FLOAT32, kind="mixed")
    x[:, ::97] *= 1e3  # a few large values on top of many small ones
    w = fill(rng, (16896,), FLOAT32)
    fast = fastattn.rms_norm_mul(x, w, 1e-6)
    expected = ref.rms_norm_mul(x, w, 1e-6, out=np.empty(x.shape))
    assert_within_rule(fast, expected, naive_f32(x, w, 1e-6), floor=0.0, what="16896")
    # three float32 roundings (scale, x * scale, * w) and nothing from the sum: relative error < 3 * 2**-24
    assert np.max(np.abs(fast - expected) / np.abs(expected)) < 3 * 2.0**-24


def test_reference_float64_out_is_the_unrounded_value():
    rng = np.random.default_rng(2)
    x = fill(rng, (3, 10), FLOAT16)
    w = fill(rng, (10,), FLOAT32)
    unrounded = ref.rms_norm_mul(x, w, 1e-5, out=np.empty(x.shape))
    assert unrounded.dtype == np.float64
    assert np.array_equal(unrounded.astype(FLOAT16), ref.rms_norm_mul(x, w, 1e-5))


@pytest.mark.parametrize("module", [fastattn, ref], ids=["fast", "reference"])
@pytest.mark.parametrize("shape, w_shape", [((0, 8), (8,)), ((2, 0), (0,)), ((2, 0), (1,)), ((0, 3, 4), (2, 1, 4))])
def test_empty_arrays(module, shape, w_shape):
    x = np.zeros(shape, np.float32)
    for op in OPS:
        result = call(op, module, x, np.ones(w_shape, np.float32), 1e-5, np.zeros_like(x))
        for r in result if op == "add_rms_norm_mul" else [result]:
            assert r.shape == shape


def test_all_zero_rows():
    zeros = np.zeros((2, 8), np.float32)
    assert np.array_equal(fastattn.rms_norm(zeros, 1e-5), zeros)
    assert np.isnan(fastattn.rms_norm(zeros, 0.0)).all() and np.isnan(ref.rms_norm(zeros, 0.0)).all()  # 0/0, as ggml


def _bad_calls():
    """(description, call(module, x, residual, w, out) -> None, exception, message pattern)."""
    return [
        ("x dtype", lambda m, x, r, w, o: m.rms_norm_mul(x.astype(np.float64), w, 1e-5, out=o), TypeError,
         "x must have dtype"),
        ("x not array", lambda m, x, r, w, o: m.rms_norm(x.tolist(), 1e-5, out=o), TypeError, "x must be"),
        ("x 0-d", lambda m, x, r, w, o: m.rms_norm(np.array(1.0, np.float32), 1e-5), ValueError,
         "x must have at least"),
        ("eps negative", lambda m, x, r, w, o: m.rms_norm(x, -1e-5, out=o), ValueError, "eps must be >= 0"),
        ("eps nan", lambda m, x, r, w, o: m.rms_norm_mul(x, w, float("nan"), out=o), ValueError, "eps must be finite"),
        ("eps str", lambda m, x, r, w, o: m.rms_norm_mul(x, w, "1e-5", out=o), TypeError, "eps must be a real"),
        ("w not dividing", lambda m, x, r, w, o: m.rms_norm_mul(x, w[:5], 1e-5, out=o), ValueError, "w must repeat"),
        ("w too many axes", lambda m, x, r, w, o: m.rms_norm_mul(x, w[None, None], 1e-5, out=o), ValueError,
         "w must repeat"),
        ("w dtype", lambda m, x, r, w, o: m.rms_norm_mul(x, w.astype(np.int32), 1e-5, out=o), TypeError,
         "w must have dtype"),
        ("out shape", lambda m, x, r, w, o: m.rms_norm_mul(x, w, 1e-5, out=o[:1]), ValueError, "out must have shape"),
        ("out dtype", lambda m, x, r, w, o: m.rms_norm(x, 1e-5, out=o.view(np.int32)), TypeError,
         "out must have dtype"),
        ("out partial alias", lambda m, x, r, w, o: m.rms_norm(x, 1e-5, out=x[::-1]), ValueError, "out overlaps x"),
        ("out overlaps w", lambda m, x, r, w, o: m.rms_norm_mul(x, x[0], 1e-5, out=x), ValueError, "out overlaps w"),
        ("residual shape", lambda m, x, r, w, o: m.add_rms_norm_mul(x, r[:1], w, 1e-5, out=o), ValueError,
         "residual must have"),
        ("residual dtype", lambda m, x, r, w, o: m.add_rms_norm_mul(x, r.astype(np.float16), w, 1e-5, out=o),
         ValueError, "residual must have"),
        ("sum_out partial alias", lambda m, x, r, w, o: m.add_rms_norm_mul(x, r, w, 1e-5, out=o, sum_out=r[::-1]),
         ValueError, "sum_out overlaps residual"),
        ("out overlaps sum_out", lambda m, x, r, w, o: m.add_rms_norm_mul(x, r, w, 1e-5, out=o, sum_out=o[::-1]),
         ValueError, "out overlaps sum_out"),
    ]


@pytest.mark.parametrize("module", [fastattn, ref], ids=["fast", "reference"])
@pytest.mark.parametrize("what, bad_call, error, message", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_inputs_raise_naming_the_argument_and_write_nothing(module, what, bad_call, error, message):
    rng = np.random.default_rng(3)
    x, r, o = (fill(rng, (4, 16), FLOAT32) for _ in range(3))
    w = fill(rng, (16,), FLOAT32)
    before = [a.tobytes() for a in (x, r, o, w)]
    with pytest.raises(error, match=message):
        bad_call(module, x, r, w, o)
    assert [a.tobytes() for a in (x, r, o, w)] == before


def test_read_only_out_is_refused():
    x = np.ones((2, 4), np.float32)
    out = np.empty_like(x)
    out.flags.writeable = False
    for module in (fastattn, ref):
        with pytest.raises(ValueError, match="out must be writeable"):
            module.rms_norm(x, 1e-5, out=out)


def test_all_storage_dtypes_are_accepted():
    for dtype in STORAGE_FLOATS:
        x = np.ones((2, 4), dtype)
        assert fastattn.rms_norm(x, 0.0).dtype == dtype


def test_contiguous_float32_kernel_vectorises():
    """The bandwidth target needs 8-wide float32 math and the 4-wide float64 sum of squares (uncached copy,
    compiled for any-layout arrays as the general path calls it: contiguous rows are retyped inside)."""
    norm = sys.modules[fastattn.rms_norm.__module__]
    uncached = numba.njit(**dict(KERNEL_OPTIONS, cache=False))(norm._norm_serial.py_func)
    any_2d = numba.types.Array(numba.types.float32, 2, "A")
    uncached.compile((any_2d, any_2d, any_2d, numba.types.float64, numba.types.boolean))  # adjacent rows
    asm = uncached.inspect_asm(uncached.signatures[0])
    assert re.search(r"vcvtps2pd\s+.*ymm", asm), "the float64 sum of squares did not vectorise"
    assert re.search(r"vmulps\s+.*ymm", asm), "the scaling loop did not vectorise"


def test_unaligned_rows_give_the_aligned_bytes():
    rng = np.random.default_rng(9)
    x = np.zeros(4 * 64 + 2, np.uint8)[2:].view(np.float32).reshape(1, 64)  # misaligned by 2 bytes
    assert not x.flags.aligned
    x[...] = fill(rng, (1, 64), FLOAT32)
    w = fill(rng, (64,), FLOAT32)
    assert fastattn.rms_norm_mul(x, w, 1e-5).tobytes() == fastattn.rms_norm_mul(x.copy(), w, 1e-5).tobytes()


@given(op=st.sampled_from(OPS), d=dims(1, 300), seed=seeds, threads=thread_counts,
       magnitude=st.sampled_from((1e-45, 1e-42, 1e-39)), serial=st.booleans())
def test_rows_of_float32_subnormals_normalise_like_the_reference(op, d, seed, threads, magnitude, serial):
    """Rows of float32 subnormals with eps = 0: mean(x²) is fine in float64 but 1/rms is beyond float32's range;
    the result is still x / rms (values around ±1), not ±inf."""
    rng = np.random.default_rng(seed)
    n_rows = 2 if serial else 600  # a decode-sized call runs serially, a large one on threads
    x = (rng.standard_normal((n_rows, d)) * magnitude).astype(np.float32)
    x[:, 0] = np.float32(magnitude) if magnitude > 1e-45 else np.float32(1e-45)  # no all-zero row
    w = rng.standard_normal(d).astype(np.float32)
    residual = np.zeros_like(x)
    with fastattn.num_threads(threads):
        fast = call(op, fastattn, x, w, 0.0, residual)
    expected = call(op, ref, x, w, 0.0, residual, out=np.empty(x.shape), **(
        {"sum_out": np.empty(x.shape)} if op == "add_rms_norm_mul" else {}))
    if op == "add_rms_norm_mul":
        fast, expected = fast[1], expected[1]
    assert np.isfinite(fast).all()
    with np.errstate(all="ignore"):
        naive = naive_f32(x.astype(np.float64), w, 0.0).astype(np.float64)  # float64: float32 would overflow too
    assert_within_rule(fast, expected, naive, floor=FLOOR, what=f"{op} {magnitude}")
