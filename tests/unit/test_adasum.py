"""The Adasum rule: its properties, zero and dtype handling, and the reduction tree."""

from __future__ import annotations

import pytest
import torch

from hora.torch.adasum import adasum_pair, adasum_reduce

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def vec(*values: float, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def test_orthogonal_vectors_add():
    a, b = vec(3.0, 0.0, 0.0), vec(0.0, -2.0, 5.0)
    assert torch.equal(adasum_pair(a, b), a + b)


def test_identical_vectors_give_the_same_vector():
    a = vec(1.5, -2.0, 4.0)
    torch.testing.assert_close(adasum_pair(a, a.clone()), a, rtol=0, atol=1e-15)


def test_opposite_vectors_cancel():
    # a.b = -|a|^2, so both coefficients are 1.5 and 1.5 a - 1.5 a = 0.
    a = vec(1.0, 2.0, -3.0)
    torch.testing.assert_close(adasum_pair(a, -a), torch.zeros(3, dtype=torch.float64),
                               rtol=0, atol=1e-15)


def test_parallel_vectors_average():
    # b = k a gives (1 - k/2) a + (1 - 1/(2k)) k a = (k + 1)/2 a, the mean of a and b.
    a = vec(1.0, -2.0, 2.0)
    torch.testing.assert_close(adasum_pair(a, 3 * a), 2 * a, rtol=0, atol=1e-14)


def test_matches_the_formula_on_general_vectors():
    torch.manual_seed(0)
    a, b = torch.randn(10, dtype=torch.float64), torch.randn(10, dtype=torch.float64)
    dot = a @ b
    expected = (1 - dot / (2 * (a @ a))) * a + (1 - dot / (2 * (b @ b))) * b
    torch.testing.assert_close(adasum_pair(a, b), expected, rtol=1e-14, atol=1e-14)


def test_is_symmetric():
    torch.manual_seed(1)
    a, b = torch.randn(7, dtype=torch.float64), torch.randn(7, dtype=torch.float64)
    torch.testing.assert_close(adasum_pair(a, b), adasum_pair(b, a), rtol=1e-15, atol=1e-15)


def test_zero_side_gives_the_other_side():
    a, zero = vec(1.0, -2.0, 3.0), torch.zeros(3, dtype=torch.float64)
    assert torch.equal(adasum_pair(zero, a), a)
    assert torch.equal(adasum_pair(a, zero), a)
    both = adasum_pair(zero, zero.clone())
    assert torch.equal(both, zero) and not torch.isnan(both).any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_dtype_and_shape_are_kept(dtype):
    a = torch.arange(6, dtype=dtype).reshape(2, 3)
    b = torch.ones(2, 3, dtype=dtype)
    out = adasum_pair(a, b)
    assert out.dtype == dtype and out.shape == (2, 3)
    expected = adasum_pair(a.to(torch.float64), b.to(torch.float64)).to(dtype)
    assert torch.equal(out, expected)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="shape"):
        adasum_pair(torch.ones(3), torch.ones(4))
    with pytest.raises(TypeError, match="dtype"):
        adasum_pair(torch.ones(3), torch.ones(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="floating point"):
        adasum_pair(torch.ones(3, dtype=torch.int64), torch.ones(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="at least one"):
        adasum_reduce([])


def random_tensors(count: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(count)
    return [torch.randn(2, 5, generator=gen).to(dtype) for _ in range(count)]


def test_reduce_of_four_is_a_tree_over_rank_order():
    t = random_tensors(4)
    expected = adasum_pair(adasum_pair(t[0], t[1]), adasum_pair(t[2], t[3]))
    assert torch.equal(adasum_reduce(t), expected)


def test_reduce_of_eight_is_a_tree_over_rank_order():
    t = random_tensors(8)
    pairs = [adasum_pair(t[i], t[i + 1]) for i in range(0, 8, 2)]
    expected = adasum_pair(adasum_pair(pairs[0], pairs[1]), adasum_pair(pairs[2], pairs[3]))
    assert torch.equal(adasum_reduce(t), expected)


def test_reduce_carries_an_unpaired_last_element_up():
    t = random_tensors(5)
    assert torch.equal(adasum_reduce(t[:3]), adasum_pair(adasum_pair(t[0], t[1]), t[2]))
    left = adasum_pair(adasum_pair(t[0], t[1]), adasum_pair(t[2], t[3]))
    assert torch.equal(adasum_reduce(t), adasum_pair(left, t[4]))
    t6 = random_tensors(6)
    left = adasum_pair(adasum_pair(t6[0], t6[1]), adasum_pair(t6[2], t6[3]))
    assert torch.equal(adasum_reduce(t6), adasum_pair(left, adasum_pair(t6[4], t6[5])))


def test_reduce_of_one_is_a_copy():
    (t,) = random_tensors(1)
    out = adasum_reduce([t])
    assert torch.equal(out, t) and out.data_ptr() != t.data_ptr()


def test_reduce_of_identical_tensors_is_that_tensor():
    (t,) = random_tensors(1, torch.float64)
    torch.testing.assert_close(adasum_reduce([t.clone() for _ in range(5)]), t,
                               rtol=1e-14, atol=1e-14)
