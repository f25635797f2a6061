"""cpu_kernels: the C++ decode-attention kernel gives SDPA's result over the same cached context,
for bf16 and fp32 caches, ragged lengths and grouped KV heads, eagerly and in a compiled graph; the
INT4 and INT8 matmuls give PyTorch's packed kernels' products from the same buffers where the CPU
runs them and refuse where it does not; an engine serving through them keeps its greedy output;
the library is built once per CPU type and then loaded from the cache; a build that fails leaves
the portable path."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.cpu import kernels as cpu_kernels
from kvpilot.engine.cpu.features import read_cpu_flags
from kvpilot.engine.model.layers import Linear
from kvpilot.engine.model.quantization import INT8_KERNEL_ROWS, Int4Layout, cpu_int4_layout
from kvpilot.engine.profiling.measure import engine_linear
from kvpilot.engine.worker.step_inputs import StepInputs
from tests.engine.conftest import make_prompts

HEADS, KV_HEADS, DIM, SLOTS = 9, 3, 64, 4096


def _load_in_a_new_process(root: Path, prebuilt: Path | None = None) -> str:
    """What a starting engine logs when it loads the kernel with this cache root (and folder of
    prebuilt libraries)."""
    code = (
        "import logging, sys; from pathlib import Path; logging.basicConfig(level=logging.INFO);"
        "from kvpilot.engine.cpu import kernels as cpu_kernels; from kvpilot.engine.cpu.features import read_cpu_flags;"
        "cpu_kernels.load(Path(sys.argv[1]), read_cpu_flags(), *(Path(a) for a in sys.argv[2:]))"
    )
    argv = [str(root)] + ([str(prebuilt)] if prebuilt else [])
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stderr


@pytest.fixture(scope="module")
def kernel_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache root a first engine built the kernel into (a process of its own: this one may have
    loaded the kernel already), loaded here too."""
    root = tmp_path_factory.mktemp("kernels")
    assert "event=cpu_kernels source=built level=" in _load_in_a_new_process(root)
    cpu_kernels.load(root, read_cpu_flags())
    return root


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, n: int) -> torch.Tensor:
    """SDPA in fp32 over the first n slots of one sequence: [heads, dim]."""
    keys = k[slots[:n]].float().transpose(0, 1).unsqueeze(0)
    values = v[slots[:n]].float().transpose(0, 1).unsqueeze(0)
    return F.scaled_dot_product_attention(q[None, :, None], keys, values, enable_gqa=True)[0, :, 0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("lengths", "dim"),
    [
        # One context within a chunk, one spanning three (the chunk merge), one exactly a chunk.
        ([5, 300, cpu_kernels._CHUNK], DIM),
        # One short context: cut into chunks of 32 so that both threads get work (and merged).
        ([100], DIM),
        # A head width that is not a multiple of the 16-lane blocks: the kernel's tails.
        ([37, 130], 80),
    ],
)
def test_it_equals_sdpa_over_ragged_contexts_of_several_sequences(
    kernel_root, dtype: torch.dtype, lengths: list[int], dim: int
) -> None:
    torch.manual_seed(0)
    k = torch.randn(SLOTS, KV_HEADS, dim).to(dtype)
    v = torch.randn(SLOTS, KV_HEADS, dim).to(dtype)
    slots = torch.zeros(len(lengths), max(lengths), dtype=torch.long)  # padding: slot 0, never read
    for i, n in enumerate(lengths):
        slots[i, :n] = torch.randperm(SLOTS)[:n]
    q = torch.randn(len(lengths), HEADS, dim)
    out = cpu_kernels.decode_attention(q, k, v, slots, torch.tensor(lengths))
    for i, n in enumerate(lengths):
        torch.testing.assert_close(out[i], _reference(q[i], k, v, slots[i], n), atol=1e-5, rtol=1e-5)
    # A compiled graph calls the registered operator with the same result.
    compiled = torch.compile(lambda q, s, n: cpu_kernels.decode_attention(q, k, v, s, n), dynamic=True)
    torch.testing.assert_close(compiled(q, slots, torch.tensor(lengths)), out)


def test_a_length_outside_the_slots_is_refused(kernel_root) -> None:
    k = v = torch.zeros(16, KV_HEADS, DIM)
    with pytest.raises(RuntimeError, match="outside 1..width"):
        cpu_kernels.decode_attention(
            torch.zeros(1, HEADS, DIM), k, v, torch.zeros(1, 4, dtype=torch.long), torch.tensor([5])
        )


def test_the_library_is_kept_per_level_and_a_second_start_loads_it(kernel_root) -> None:
    flags = read_cpu_flags()
    assert "event=cpu_kernels source=cache" in _load_in_a_new_process(kernel_root)
    kernels = kernel_root / cpu_kernels.KERNELS
    assert (kernels / f"{cpu_kernels.library_name(cpu_kernels.level_for(flags))}.so").is_file()
    assert not list(kernels.glob(".build-*")), "the build directory was left behind"


ZEN5 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"})
ZEN5 |= {"avx512_bf16", "avx512_vnni"}
ICE_LAKE = ZEN5 - {"avx512_bf16"}


def test_the_level_follows_the_flags_and_names_the_library() -> None:
    # x86-64's levels, whatever machine runs the test.
    x86 = cpu_kernels.LEVELS

    def level(flags: frozenset[str]) -> str:
        return cpu_kernels.level_for(flags, x86).name

    assert level(ZEN5) == "avx512-bf16"
    assert level(ICE_LAKE) == "avx512"
    assert level(frozenset({"avx2", "fma", "f16c"})) == "avx2"
    assert level(frozenset({"avx512f", "avx2", "fma", "f16c"})) == "avx2"  # AVX512F alone: not at::vec's AVX512
    assert level(frozenset({"sse4_2"})) == "baseline"
    # Both matmuls run from AVX2 on; the baseline has neither.
    assert cpu_kernels.matmul_schemes(ZEN5, x86) == {"int8", "int4"}
    assert cpu_kernels.matmul_schemes(ICE_LAKE, x86) == {"int8", "int4"}
    assert cpu_kernels.matmul_schemes(frozenset({"avx512f", "avx2", "fma", "f16c"}), x86) == {"int8", "int4"}
    assert cpu_kernels.matmul_schemes(frozenset({"sse4_2"}), x86) == set()
    # A level is built with exactly its own switches, never for the build machine's CPU.
    widest = cpu_kernels.level_for(ZEN5, x86)
    assert "-mavx512bf16" in widest.cflags and "-DCPU_CAPABILITY=AVX512" in widest.cflags
    assert not [f for f in widest.cflags if f.startswith("-march")]
    assert "-DCPU_CAPABILITY=DEFAULT" in cpu_kernels.BASELINE.cflags
    # CPUs of one level share a library (flags the kernels do not use change nothing); levels do not.
    assert cpu_kernels.library_name(cpu_kernels.level_for(ZEN5 | {"sha_ni"}, x86)) == cpu_kernels.library_name(widest)
    names = {cpu_kernels.library_name(level) for level in cpu_kernels.LEVELS}
    assert len(names) == len(cpu_kernels.LEVELS)


def test_a_prebuilt_library_serves_when_the_cache_has_none(kernel_root, tmp_path) -> None:
    """An image's libraries ($KVPILOT_CACHE/kernels, `kvpilot build-kernels`): a start with an empty
    compile cache loads this CPU's level from there and builds nothing."""
    empty = tmp_path / "compile-cache"
    logged = _load_in_a_new_process(empty, kernel_root / cpu_kernels.KERNELS)
    level = cpu_kernels.level_for(read_cpu_flags())
    assert f"event=cpu_kernels source=prebuilt level={level.name}" in logged
    assert not empty.exists()


def test_decode_groups_carry_lengths_for_the_kernel_and_no_mask() -> None:
    inputs = StepInputs(16, torch.device("cpu"), decode_kernel=True)
    inputs.add([1], 20, [0, 1], decode=True)
    inputs.add([2], 3, [2], decode=True)
    inputs.add([3, 4], 40, [3, 4, 5], decode=True)  # a decode with a draft: SDPA with its mask
    groups = inputs.build()[2].decodes
    assert groups[0].lengths.tolist() == [21, 4] and groups[0].mask is None
    assert groups[1].lengths is None and groups[1].mask is not None


def test_every_cpu_engine_serves_on_the_kernels_and_says_so(kernel_root, caplog) -> None:
    """Not only compile_decode engines: the library loads at every CPU engine's start."""
    with caplog.at_level(logging.INFO):
        runner = LLM(dtype="float32", quantization="int8", kv_cache_memory_bytes=16 << 20).engine.runner
    schemes = cpu_kernels.matmul_schemes(read_cpu_flags())
    assert runner.decode_kernel and runner.matmul_kernels == schemes
    assert runner.model.lm_head.quantization.cpu_kernel == ("int8" in schemes)
    assert "event=cpu_kernels_used attention=single_query_decodes" in caplog.text


def test_a_failed_build_leaves_the_portable_path(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    def fail(*args: object) -> None:
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(cpu_kernels, "load", fail)
    with caplog.at_level(logging.WARNING):
        llm = LLM(dtype="float32", quantization="int8", kv_cache_memory_bytes=16 << 20)
    runner = llm.engine.runner
    assert "cpu_kernels_unavailable" in caplog.text and "no compiler today" in caplog.text
    runner.use_cpu_kernels(True)  # refused: nothing is loaded
    assert runner.decode_kernel is False and not runner.model.lm_head.quantization.cpu_kernel
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4  # it serves on PyTorch's kernels


def test_without_a_compiler_or_a_cached_library_load_says_what_is_missing(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(cpu_kernels, "_loaded", False)
    monkeypatch.setattr(cpu_kernels, "has_compiler", lambda: False)
    with pytest.raises(RuntimeError, match=r"no C\+\+ compiler .* none cached at .*kernels"):
        cpu_kernels.load(tmp_path, read_cpu_flags())


def _close_to(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to 2 % of the largest output."""
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2 * want.abs().max().item(), rtol=1e-2)


def _pack_int4(q: torch.Tensor, rows: int) -> torch.Tensor:
    """q [out, in] in 0..15 in PyTorch's CPU int4 layout of `rows`-row blocks (byte i of a block's
    column: rows i and i + rows / 2), which ATen writes only where it runs that ISA."""
    out_features, in_features = q.shape
    blocks = q.view(out_features // rows, rows, in_features).permute(0, 2, 1)  # [block, in, rows]
    packed = (blocks[..., : rows // 2] | (blocks[..., rows // 2 :] << 4)).to(torch.uint8)
    return packed.contiguous().view(out_features, in_features // 2)  # the shape ATen gives it


def _int4_case(
    tokens: int, out: int, width: int, group: int, rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random 4-bit weights q [out, in], x [tokens, in] bf16, q packed in `rows`-row blocks, the
    groups' bf16 scales and zeros, and the exact product x @ ((q - 8) scale + zero).T in fp32."""
    q = torch.randint(0, 16, (out, width), dtype=torch.int32)
    scales, zeros = torch.rand(width // group, out) * 0.02 + 1e-3, torch.randn(width // group, out) * 0.02
    scales_zeros = torch.stack([scales, zeros], dim=-1).to(torch.bfloat16).contiguous()
    x = torch.randn(tokens, width, dtype=torch.bfloat16)
    scale, zero = (t.float().T.repeat_interleave(group, dim=1) for t in scales_zeros.unbind(-1))
    return q, x, _pack_int4(q, rows), scales_zeros, x.float() @ ((q - 8) * scale + zero).T


@pytest.mark.parametrize("tokens", [1, 3, 4, 5, 37])
@pytest.mark.parametrize(("out", "width", "group"), [(960, 576, 32), (128, 1536, 64)])
@pytest.mark.parametrize("rows", cpu_kernels.INT4_BLOCK_ROWS)
def test_int4_mm_gives_the_int4_product(kernel_root, tokens: int, out: int, width: int, group: int, rows: int) -> None:
    """Of either layout, on this CPU (bf16 dot products, or integer ones of 16-bit activations): the
    exact product up to the output's bf16 rounding (a wrong row or group moves it by tens), and
    PyTorch's where ATen packs that layout here."""
    torch.manual_seed(tokens)
    q, x, packed, scales_zeros, exact = _int4_case(tokens, out, width, group, rows)
    flags = read_cpu_flags()
    if "int4" not in cpu_kernels.matmul_schemes(flags):
        with pytest.raises(RuntimeError, match="needs AVX2"):
            cpu_kernels.int4_mm(x, packed, group, scales_zeros, rows)
        return
    got = cpu_kernels.int4_mm(x, packed, group, scales_zeros, rows)
    assert got.shape == exact.shape and got.dtype == torch.bfloat16
    _close_to(got, exact)
    if cpu_int4_layout() == Int4Layout(rows, False):
        assert torch.equal(packed, torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2))
        _close_to(got, torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_zeros))
    compiled = torch.compile(lambda x: cpu_kernels.int4_mm(x, packed, group, scales_zeros, rows), dynamic=True)
    torch.testing.assert_close(compiled(x), got)


@pytest.mark.parametrize("tokens", [1, 7, 8, 9, 20])
def test_int8_mm_gives_pytorchs_packed_product(kernel_root, tokens: int) -> None:
    torch.manual_seed(tokens)
    weight = torch.randint(-127, 128, (1000, 584), dtype=torch.int8)  # 584: a tail after the last 16 columns
    scales = (torch.rand(1000) * 0.01).to(torch.bfloat16)
    x = torch.randn(tokens, 584, dtype=torch.bfloat16)
    if "int8" not in cpu_kernels.matmul_schemes(read_cpu_flags()):
        with pytest.raises(RuntimeError, match="needs AVX2 or AVX512"):
            cpu_kernels.int8_mm(x, weight, scales)
        return
    got = cpu_kernels.int8_mm(x, weight, scales)
    # The product in fp32: PyTorch's kernel is wrong at this width (values off by up to 3e38 with
    # torch 2.15), so it is compared only on the first 576 columns.
    _close_to(got, (x.float() @ weight.float().T) * scales.float())
    aligned = (x[:, :576].contiguous(), weight[:, :576].contiguous(), scales)
    _close_to(cpu_kernels.int8_mm(*aligned), torch.ops.aten._weight_int8pack_mm(*aligned))
    compiled = torch.compile(lambda x: cpu_kernels.int8_mm(x, weight, scales), dynamic=True)
    torch.testing.assert_close(compiled(x), got)


def test_an_int4_engine_on_the_kernels_keeps_its_greedy_output(kernel_root, monkeypatch, corpus_ids) -> None:
    """The same engine's greedy tokens on PyTorch's kernels and then on these: equal, or apart at a
    near-tie of the first run's logprobs; every quantized layer the CPU has a kernel for uses it."""
    llm = LLM(quantization="int4", kv_cache_memory_bytes=16 << 20)
    runner = llm.engine.runner
    prompts = make_prompts(corpus_ids, [7, 60, 200])
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=2)
    runner.use_cpu_kernels(False)
    before = llm.generate(prompts, params)
    schemes = cpu_kernels.matmul_schemes(read_cpu_flags())
    runner.use_cpu_kernels(True, schemes)
    assert runner.decode_kernel and runner.matmul_kernels == schemes
    layers = [m for m in runner.model.modules() if isinstance(m, Linear) and m.quantization is not None]
    assert all(m.quantization.cpu_kernel == (m.quantization.name in schemes) for m in layers)
    calls = {"int4": 0, "int8": 0}
    for name in calls:
        kernel = getattr(cpu_kernels, f"{name}_mm")
        monkeypatch.setattr(cpu_kernels, f"{name}_mm", _counted(kernel, calls, name))
    after = llm.generate(prompts, params)
    assert all(calls[name] > 0 for name in schemes) and all(calls[name] == 0 for name in calls if name not in schemes)
    for prompt, old, new in zip(prompts, before, after):
        a, b = old.outputs[0], new.outputs[0]
        first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        # The quantized matmuls take bf16 activations: one rounding apart moves a logprob by ~1e-2,
        # and the next tokens compound it (up to 0.21 on an AVX2 CPU, where only attention changes);
        # a wrong kernel moves them by units.
        moved = [abs(a.logprobs[i].top[0].logprob - b.logprobs[i].top[0].logprob) for i in range(first)]
        drift = max(moved, default=0.0)
        assert drift < 0.5, (len(prompt), drift)
        if first == len(a.token_ids):
            continue
        # A flip is a near-tie: its top-2 gap within what the shared tokens moved (each logprob by up to
        # `drift`, so their gap by twice that), or 0.05 where they barely moved.
        top = a.logprobs[first].top
        gap = top[0].logprob - top[1].logprob
        assert gap <= max(0.05, 2 * drift) and b.token_ids[first] in {t.token_id for t in top[:2]}, (
            len(prompt),
            first,
            gap,
            drift,
        )


def _counted(kernel, calls: dict[str, int], name: str):
    def counted(*args: torch.Tensor) -> torch.Tensor:
        calls[name] += 1
        return kernel(*args)

    return counted


def test_int8_layers_narrower_than_the_kernels_gain_keep_pytorchs(kernel_root, monkeypatch) -> None:
    calls = {"int8": 0}
    monkeypatch.setattr(cpu_kernels, "int8_mm", _counted(cpu_kernels.int8_mm, calls, "int8"))
    for rows, ours in ((576, False), (INT8_KERNEL_ROWS, "int8" in cpu_kernels.matmul_schemes(read_cpu_flags()))):
        layer = engine_linear("int8", torch.bfloat16, (rows, 576))
        before = calls["int8"]
        y = layer(torch.randn(2, 576, dtype=torch.bfloat16))
        assert y.shape == (2, rows) and (calls["int8"] > before) == ours, rows


def test_build_kernels_refuses_a_level_it_does_not_know(capsys) -> None:
    from kvpilot.engine.cli import main

    assert main(["build-kernels", "--levels", "avx512,avx9000"]) == 2
    err = capsys.readouterr().err
    assert "avx9000" in err and all(level.name in err for level in cpu_kernels.BUILDABLE)


def _errors_at_level(root: str, name: str) -> dict[str, list[float] | str]:
    """In a process of its own: the library of one level loaded as a CPU of exactly its flags
    would, and each product's (largest error, largest exact value), or the kernel's refusal."""
    level = next(level for level in cpu_kernels.LEVELS if level.name == name)
    cpu_kernels.load(Path(root), level.needs)
    torch.manual_seed(0)
    found: dict[str, list[float] | str] = {}

    def measure(what: str, kernel: Callable[..., torch.Tensor], args: tuple, exact: torch.Tensor) -> None:
        try:
            found[what] = [(kernel(*args).float() - exact).abs().max().item(), exact.abs().max().item()]
        except RuntimeError as refusal:
            found[what] = str(refusal)

    for rows in cpu_kernels.INT4_BLOCK_ROWS:
        for tokens, group in ((1, 32), (5, 64)):
            _, x, packed, scales_zeros, exact = _int4_case(tokens, 960, 576, group, rows)
            measure(
                f"int4 rows {rows} tokens {tokens}", cpu_kernels.int4_mm, (x, packed, group, scales_zeros, rows), exact
            )
    weight = torch.randint(-127, 128, (512, 584), dtype=torch.int8)
    scales, x = (torch.rand(512) * 0.01).to(torch.bfloat16), torch.randn(9, 584, dtype=torch.bfloat16)
    measure("int8", cpu_kernels.int8_mm, (x, weight, scales), (x.float() @ weight.float().T) * scales.float())
    k, v = torch.randn(SLOTS, KV_HEADS, DIM), torch.randn(SLOTS, KV_HEADS, DIM)
    slots, q = torch.randperm(SLOTS)[:300][None].contiguous(), torch.randn(1, HEADS, DIM)
    attention = cpu_kernels.decode_attention(q, k, v, slots, torch.tensor([300]))[0]
    exact = _reference(q[0], k, v, slots[0], 300)
    found["attention"] = [(attention - exact).abs().max().item(), exact.abs().max().item()]
    return found


def test_every_narrower_level_this_cpu_runs_gives_the_same_products(tmp_path) -> None:
    """The code another CPU type runs, built here for its level and run as it would be (on an
    AVX512-BF16 CPU, the avx512 level is an Ice Lake's INT4 product of 16-bit integers and avx2 a
    Zen 3's):
    each product exact up to its bf16 rounding, and the matmuls refused where the level has no
    kernel for them. The level of this CPU itself is what the tests above run."""
    narrower = cpu_kernels.runnable_levels(read_cpu_flags())[1:]
    assert narrower or cpu_kernels.BUILDABLE == (cpu_kernels.BASELINE,)
    code = (
        "import json, sys; from tests.engine.cpu.test_cpu_kernels import _errors_at_level;"
        "print(json.dumps(_errors_at_level(sys.argv[1], sys.argv[2])))"
    )
    root = Path(__file__).resolve().parents[3]
    for level in narrower:
        done = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path), level.name],
            capture_output=True,
            text=True,
            timeout=900,
            cwd=root,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        found = json.loads(done.stdout.splitlines()[-1])
        assert len(found) == 2 * len(cpu_kernels.INT4_BLOCK_ROWS) + 2, found
        for what, result in found.items():
            if what != "attention" and "avx2" not in level.needs:
                assert isinstance(result, str) and "needs AVX2" in result, (level.name, what, result)
                continue
            assert not isinstance(result, str), (level.name, what, result)
            error, largest = result
            assert error <= (1e-5 if what == "attention" else 2e-2) * largest, (level.name, what, error, largest)
