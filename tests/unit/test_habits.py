"""FlexAttention habits get errors that say what to write instead (issue 29, point 5).

A user coming from torch's flex_attention / scaled_dot_product_attention writes torch inside a
score_mod, captures torch tensors, passes block_mask= and bfloat16 tensors: each raises an
exception naming the argument and what attnext takes instead. A callable object reading
self.table is traced (its arrays captured as "self.table"). The command lines: bench --help
shows everything, fuzz refuses a budget that would run nothing. All on the CPU path; the torch
cases skip without torch (attnext itself never imports it).
"""
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import attnext
from attnext.bench import cli, cpu as bench_cpu
from attnext.testing import fuzz

B, S, H, D = 1, 8, 2, 16
_rng = np.random.default_rng(29)
Q, K, V = (_rng.standard_normal((B, S, H, D)).astype(np.float32) for _ in range(3))
DEVICES = ["cpu", "reference"]


def _torch():
    return pytest.importorskip("torch")


def _call(device, **mods):
    return attnext.attention(Q, K, V, device=device, **mods)


# --- torch functions and tensor methods inside a callback --------------------------------------

def _torch_score_mods(torch):
    return {
        "where": (lambda s, b, h, q, k: torch.where(q >= k, s, -float("inf")), "np.where"),
        "tanh": (lambda s, b, h, q, k: 30 * torch.tanh(s / 30), "np.tanh"),
        "clamp": (lambda s, b, h, q, k: torch.clamp(s, -5.0, 5.0), "np.clip(x, lo, hi)"),
        "sigmoid": (lambda s, b, h, q, k: s * torch.sigmoid(s), "1 / (1 + np.exp(-x))"),
        "exp": (lambda s, b, h, q, k: s + torch.exp(-torch.abs(q - k)), "np.abs"),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["where", "tanh", "clamp", "sigmoid", "exp"])
def test_torch_function_in_score_mod_says_which_numpy(op, device):
    torch = _torch()
    fn, hint = _torch_score_mods(torch)[op]
    with pytest.raises(TypeError, match=r"^score_mod: torch\.\w+ on a traced value: write ") as e:
        _call(device, score_mod=fn)
    assert hint in str(e.value) and "NumPy functions" in str(e.value)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_function_in_mask_mod(device):
    torch = _torch()

    def causal(b, h, q_idx, kv_idx):
        return torch.logical_and(q_idx >= kv_idx, kv_idx >= 0)
    with pytest.raises(TypeError, match=r"^mask_mod: torch\.logical_and on a traced value: "
                                        r"write np\.logical_and"):
        _call(device, mask_mod=causal)


def test_torch_function_without_a_numpy_twin():
    torch = _torch()
    with pytest.raises(TypeError, match=r"torch\.softmax on a traced value: no traced NumPy "
                                        r"function is close .*docs/score_mod\.md"):
        _call("cpu", score_mod=lambda s, b, h, q, k: torch.softmax(s, 0))


@pytest.mark.parametrize("method, hint", [("exp", "np.exp(x)"), ("sigmoid", "1 / (1 + np.exp(-x))"),
                                          ("clamp", "np.clip(x, lo, hi)"), ("item", "the expression")])
def test_tensor_method_on_a_traced_value(method, hint):
    """score.exp() and friends: no torch needed, the traced value has no such method."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return getattr(score, method)()
    with pytest.raises(AttributeError, match=rf"^score_mod: a traced value has no method \.{method}\(\) \(it is no torch "
                                             r"tensor") as e:
        _call("cpu", score_mod=score_mod)
    assert hint in str(e.value)


# --- a captured torch tensor ---------------------------------------------------------------------

TABLE_T = None     # a module global torch tensor (set by the test that reads it)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["closure", "global", "default", "self"])
def test_captured_torch_cpu_tensor_is_read_as_numpy(where, device):
    """A torch CPU tensor captured by name is read as the NumPy array it shares memory with, on
    the CPU backend and the reference alike; its gradient comes back as a torch tensor under its
    name (docs/score_mod.md, captured arrays)."""
    torch = _torch()
    global TABLE_T
    bias_t = torch.randn(S, S)
    TABLE_T = bias_t
    twin = bias_t.numpy().copy()

    def closure(score, b, h, q_idx, kv_idx):
        return score + bias_t[q_idx, kv_idx]

    def by_global(score, b, h, q_idx, kv_idx):
        return score + TABLE_T[q_idx, kv_idx]

    def default(score, b, h, q_idx, kv_idx, table=bias_t):
        return score + table[q_idx, kv_idx]

    class Bias:
        def __init__(self):
            self.table = bias_t

        def __call__(self, score, b, h, q_idx, kv_idx):
            return score + self.table[q_idx, kv_idx]

    def numpy_twin(score, b, h, q_idx, kv_idx):
        return score + twin[q_idx, kv_idx]
    fn, name = {"closure": (closure, "bias_t"), "global": (by_global, "TABLE_T"),
                "default": (default, "table"), "self": (Bias(), "self.table")}[where]
    out, lse = attnext.attention(Q, K, V, score_mod=fn, device=device, return_lse=True)
    want, want_lse = attnext.attention(Q, K, V, score_mod=numpy_twin, device=device, return_lse=True)
    np.testing.assert_array_equal(out, want)
    dout = np.ones_like(out)
    g = attnext.attention_backward(dout, Q, K, V, out, lse, score_mod=fn, device=device)
    w = attnext.attention_backward(dout, Q, K, V, want, want_lse, score_mod=numpy_twin, device=device)
    assert list(g.dtensors) == [name] and isinstance(g.dtensors[name], torch.Tensor)
    np.testing.assert_array_equal(g.dtensors[name].numpy(), w.dtensors["twin"])


def test_captured_torch_tensor_in_mask_mod_and_bfloat16():
    torch = _torch()
    doc_t = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    doc = doc_t.numpy().copy()
    np.testing.assert_array_equal(_call("cpu", mask_mod=lambda b, h, q, k: doc_t[q] == doc_t[k]),
                                  _call("cpu", mask_mod=lambda b, h, q, k: doc[q] == doc[k]))
    rel_t = torch.zeros(2 * S, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"^score_mod: captured array 'rel_t': rel_t is a torch "
                                        r"bfloat16 tensor on the cpu, which NumPy cannot read") as e:
        _call("cpu", score_mod=lambda s, b, h, q, k: s + rel_t[q - k + S])
    assert ("rel_t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)" in str(e.value)
            and "rel_t.float().numpy()" in str(e.value))


def test_torch_scalar_tensor_combined_with_a_traced_value():
    """A 0-d torch CPU tensor captured by name is a scalar lookup, as a 0-d NumPy array is."""
    torch = _torch()
    temperature = torch.tensor(2.0)
    for fn, twin in ((lambda s, b, h, q, k: s / temperature, lambda s, b, h, q, k: s * 0.5),
                     (lambda s, b, h, q, k: temperature * s, lambda s, b, h, q, k: 2.0 * s)):
        np.testing.assert_allclose(_call("cpu", score_mod=fn), _call("cpu", score_mod=twin), rtol=1e-6)


def test_len_and_shape_of_a_captured_torch_tensor_still_work():
    """Only reading a torch tensor with a traced value is refused: its len() is a Python int."""
    torch = _torch()
    table = torch.arange(S)
    out = _call("cpu", mask_mod=lambda b, h, q, k: k < len(table) - 2)
    ref = attnext.reference.attention(Q, K, V, mask=np.arange(S) < S - 2)
    np.testing.assert_allclose(out, ref, atol=1e-5)


# --- callable objects and bound methods: self.table captured ------------------------------------

class RelBias:
    """A callable object reading its table through self, as torch modules do."""

    def __init__(self, rng):
        self.table = rng.standard_normal((S, S)).astype(np.float32)
        self.gain = 0.5

    def __call__(self, score, b, h, q_idx, kv_idx):
        return score + self.gain * self.lookup(q_idx, kv_idx)

    def lookup(self, i, j):
        return self.table[i, j]


class Documents:
    def __init__(self):
        self.doc = np.array([0, 0, 0, 1, 1, 1, 2, 2])

    def mask(self, b, h, q_idx, kv_idx):
        return self.doc[q_idx] == self.doc[kv_idx]


@pytest.mark.parametrize("device", DEVICES)
def test_callable_object_reading_self_table(device):
    rel, docs = RelBias(np.random.default_rng(1)), Documents()
    table, doc = rel.table, docs.doc

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + 0.5 * table[q_idx, kv_idx]

    def mask_mod(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]
    out, lse = attnext.attention(Q, K, V, score_mod=rel, mask_mod=docs.mask, device=device,
                                 return_lse=True)
    want, want_lse = attnext.attention(Q, K, V, score_mod=score_mod, mask_mod=mask_mod,
                                       device=device, return_lse=True)
    np.testing.assert_array_equal(out, want)
    dout = np.ones_like(out)
    g = attnext.attention_backward(dout, Q, K, V, out, lse, score_mod=rel, mask_mod=docs.mask,
                                   device=device)
    w = attnext.attention_backward(dout, Q, K, V, want, want_lse, score_mod=score_mod,
                                   mask_mod=mask_mod, device=device)
    assert list(g.dtensors) == ["self.table"]
    np.testing.assert_array_equal(g.dtensors["self.table"], w.dtensors["table"])
    np.testing.assert_array_equal(g.dq, w.dq)


def test_callable_object_reads_its_table_afresh():
    rel = RelBias(np.random.default_rng(2))
    first = _call("cpu", score_mod=rel)
    rel.table = np.zeros_like(rel.table)
    np.testing.assert_array_equal(_call("cpu", score_mod=rel), _call("cpu"))
    assert not np.array_equal(first, _call("cpu"))


class Scaled:
    """A static helper is called as it is (no self to bind), beside self.table."""

    def __init__(self):
        self.table = np.full(S, 0.25, np.float32)

    @staticmethod
    def twice(x):
        return 2 * x

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self.twice(score) + self.table[kv_idx]


def test_callable_object_with_static_methods():
    out = _call("cpu", score_mod=Scaled())
    want = _call("reference", score_mod=Scaled())
    np.testing.assert_allclose(out, want, atol=1e-5)


# --- block_mask= and the other keywords of torch's attention functions ---------------------------

def _public_calls():
    cu = np.array([0, S], np.int32)
    out, lse = attnext.attention(Q, K, V, device="cpu", return_lse=True)
    vout, vlse = attnext.varlen_attention(Q[0], K[0], V[0], cu, cu, device="cpu", return_lse=True)
    return {
        "attention": lambda **kw: attnext.attention(Q, K, V, **kw),
        "varlen_attention": lambda **kw: attnext.varlen_attention(Q[0], K[0], V[0], cu, cu, **kw),
        "attention_backward": lambda **kw: attnext.attention_backward(out, Q, K, V, out, lse, **kw),
        "varlen_attention_backward": lambda **kw: attnext.varlen_attention_backward(
            vout, Q[0], K[0], V[0], vout, vlse, cu, cu, **kw),
    }


@pytest.mark.parametrize("fn", ["attention", "varlen_attention", "attention_backward",
                                "varlen_attention_backward"])
def test_block_mask_keyword_says_mask_mod(fn):
    call = _public_calls()[fn]
    with pytest.raises(TypeError, match=rf"^{fn}\(\) got an unexpected keyword argument "
                                        r"'block_mask': pass the mask function itself as "
                                        r"mask_mod=fn") as e:
        call(block_mask=attnext.block_mask(lambda b, h, q, k: q >= k, S, S), device="cpu")
    assert "attnext.block_mask(mask_mod, Sq, Sk) only shows" in str(e.value)

    class FlexBlockMask:           # torch's BlockMask carries its mask_mod
        def mask_mod(self, b, h, q_idx, kv_idx):
            return q_idx >= kv_idx
    with pytest.raises(TypeError, match=r"a torch BlockMask: mask_mod=block_mask\.mask_mod"):
        call(block_mask=FlexBlockMask(), device="cpu")


@pytest.mark.parametrize("key, hint", [("is_causal", "causal=True"), ("attn_mask", "mask="),
                                       ("enable_gqa", "automatic"), ("dropout_p", "no dropout"),
                                       ("return_aux", "return_lse=True")])
def test_sdpa_keywords_say_what_to_write(key, hint):
    with pytest.raises(TypeError, match=rf"unexpected keyword argument '{key}' \(a keyword of "
                                        r"torch's scaled_dot_product_attention") as e:
        attnext.attention(Q, K, V, device="cpu", **{key: True})
    assert hint in str(e.value)


def test_public_functions_keep_their_signatures():
    import inspect
    assert "block_mask" not in inspect.signature(attnext.attention).parameters
    assert list(inspect.signature(attnext.attention).parameters)[:3] == ["q", "k", "v"]
    assert attnext.attention.__doc__ == attnext.api.attention.__wrapped__.__doc__


# --- a torch bfloat16 tensor on the host -------------------------------------------------------

@pytest.mark.parametrize("name", ["q", "bias"])
def test_torch_bfloat16_host_tensor_says_ml_dtypes(name):
    torch = _torch()
    t = torch.from_numpy(Q).to(torch.bfloat16)
    args = dict(q=t, k=t, v=t) if name == "q" else dict(q=Q, k=K, v=V)
    opts = dict(bias=torch.zeros(S, S, dtype=torch.bfloat16)) if name == "bias" else {}
    with pytest.raises(TypeError, match=rf"^{name} is a torch bfloat16 tensor on the cpu, which "
                                        r"NumPy cannot read") as e:
        attnext.attention(args["q"], args["k"], args["v"], device="cpu", **opts)
    assert (f"{name}.view(torch.int16).numpy().view(ml_dtypes.bfloat16)" in str(e.value)
            and f"{name}.float().numpy()" in str(e.value))


def test_the_bfloat16_recipe_runs():
    torch = _torch()
    t = torch.from_numpy(Q).to(torch.bfloat16).requires_grad_()
    with pytest.raises(TypeError, match=r"q\.detach\(\)\.view\(torch\.int16\)"):
        attnext.attention(t, t, t, device="cpu")
    q = t.detach().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    assert q.dtype == ml_dtypes.bfloat16
    out = attnext.attention(q, q, q, device="cpu")
    want = attnext.attention(t.detach().float().numpy(), *(t.detach().float().numpy(),) * 2,
                             device="cpu")
    np.testing.assert_allclose(out.astype(np.float32), want, atol=0.05)


# --- the command lines --------------------------------------------------------------------------

@pytest.mark.parametrize("form", ["cpu", "cuda"])
def test_bench_help_prints_everything(form):
    parser = bench_cpu.parser() if form == "cpu" else cli.cuda_parser()
    argv = ["--help"] if form == "cpu" else ["--device", "cuda", "--help"]
    res = subprocess.run([sys.executable, "-m", "attnext.bench", *argv], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())         # argparse re-wraps the options' help
    doc = (bench_cpu if form == "cpu" else cli.cuda).__doc__
    for line in doc.strip().splitlines():      # the whole description, as written
        assert line.strip() in res.stdout, line
    for action in parser._actions:
        assert action.help and action.help.strip(), action.option_strings
        for opt in action.option_strings:
            assert opt in res.stdout, opt
        if action.dest != "help":
            assert " ".join(action.help.split()) in text, action.option_strings


@pytest.mark.parametrize("minutes", ["-1", "0", "nan", "inf"])
def test_fuzz_refuses_a_budget_that_runs_nothing(minutes, capsys):
    with pytest.raises(SystemExit) as e:
        fuzz.main(["--minutes", minutes, "--backends", "cpu"])
    assert e.value.code == 2
    assert "argument --minutes: must be a positive, finite number of minutes" in capsys.readouterr().err


def test_fuzz_minus_one_from_the_shell():
    res = subprocess.run([sys.executable, "-m", "attnext.fuzz", "--minutes", "-1"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--minutes: must be a positive" in res.stderr
    assert "cases run" not in res.stdout

