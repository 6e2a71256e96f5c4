"""The decoder compiled ahead of time (``nas.export.aot``, AOTInductor) searches as the eager decoder does.

The reference is :func:`nas.model.beam_search` on the same weights (itself checked against decoding without the
cache in ``tests/model/test_decoding.py``): the same tokens, scores within 1e-4 (the compiled kernels sum in other
orders), for a plain arch and for one with every unified family in the decoder (branches, paths, units, a Prime
layer's causal-convolution state, HAT's attention over two encoder layers), through both packages (ranking in the graph for
few rows, from logits for many), free-length search (sentences finishing at different steps leave the batch)
and fixed-length search (EOS forced at the bound, also where the bound comes before ``min_len``).
"""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from nas.cli import app
from nas.data import Tokenizer, read_lines
from nas.export import export_arch, load_export
from nas.export.aot import VARIANTS, AotTranslator, package_key
from nas.export.folder import Exported
from nas.model import SuperTransformer, beam_search, extract
from nas.model.io import save_model
from tests.export.archs import MIXED, MIXED_MAXIMA, PLAIN, varied

SMALL_ROWS = 8  # 2 sentences x 3 beams run the package that ranks in its graph, 5 x 3 the other

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),  # tests/conftest.py
              pytest.mark.slow]  # each package compiles in 10-30 s on 2 cores: out of the inner loop



@pytest.fixture(scope="module")
def tokenizer(multi30k, tmp_path_factory) -> Tokenizer:
    lines = read_lines(multi30k / "train.en.gz", limit=300) + read_lines(multi30k / "train.de.gz", limit=300)
    return Tokenizer.train(lines, tmp_path_factory.mktemp("spm") / "spm", vocab_size=300)


@pytest.fixture(scope="module")
def sentences(multi30k) -> list[str]:
    return read_lines(multi30k / "test_2016_flickr.en.gz", limit=5)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("aot")


@pytest.fixture(scope="module")
def models(tokenizer, tmp_path_factory) -> dict:
    """The PLAIN export folder (from a saved supernet) and MIXED extracted from a supernet, as ``Exported``."""
    root = tmp_path_factory.mktemp("aot_models")
    torch.manual_seed(0)
    save_model(varied(SuperTransformer(tokenizer.vocab_size, 32, 2, PLAIN, max_positions=64)), root / "sn",
               "supernet")
    plain = export_arch(root / "sn", tokenizer.model_path, PLAIN, root / "plain", beam_size=3)
    torch.manual_seed(1)
    mixed = extract(varied(SuperTransformer(tokenizer.vocab_size, 32, 2, MIXED_MAXIMA, max_positions=64)), MIXED)
    return {"plain": plain, "mixed": Exported(mixed.eval(), tokenizer, MIXED, 3)}


def _sources(tokenizer: Tokenizer, sentences: list[str]) -> torch.Tensor:
    ids = [x + [3] for x in tokenizer.encode(sentences)]  # EOS = 3
    src = torch.zeros(len(ids), max(map(len, ids)), dtype=torch.long)  # PAD = 0: the shorter rows are padded
    for i, row in enumerate(ids):
        src[i, :len(row)] = torch.tensor(row)
    return src


def _wrapper(package: Path) -> str:
    """The C++ wrapper AOTInductor generated for a package (the calls of its extern kernels)."""
    with zipfile.ZipFile(package) as z:
        return "".join(z.read(name).decode() for name in z.namelist() if name.endswith(".wrapper.cpp"))


def _assert_same(got, want) -> None:
    (hyps, scores), (ref_hyps, ref_scores) = got, want
    assert hyps == ref_hyps
    assert max(abs(a - b) for a, b in zip(scores, ref_scores)) < 1e-4


@pytest.mark.parametrize("name, sentences_in_batch", [("plain", 2), ("plain", 5), ("mixed", 5)])  # the unified
def test_compiled_search_equals_the_eager_search(models, tokenizer, sentences, cache_dir, name, sentences_in_batch):
    # arch through one step package (compile time); the plain arch through both
    translator = AotTranslator(models[name], 3, cache_dir=cache_dir, small_rows=SMALL_ROWS)
    model = translator.model
    src = _sources(tokenizer, sentences[:sentences_in_batch])
    free = beam_search(model, src, beam_size=3, return_scores=True)
    assert len({len(h) for h in free[0]}) > 1  # the sentences finish at different steps
    _assert_same(translator.beam_search(src, return_scores=True), free)
    fixed = dict(max_len_a=0.0, max_len_b=9, min_len=9)
    _assert_same(translator.beam_search(src, return_scores=True, **fixed),
                 beam_search(model, src, beam_size=3, return_scores=True, **fixed))
    early = dict(max_len_a=0.0, max_len_b=4, min_len=9)  # the limit before min_len: EOS forced while banned (score 0)
    _assert_same(translator.beam_search(src, return_scores=True, **early),
                 beam_search(model, src, beam_size=3, return_scores=True, **early))
    runner, candidates = translator.runner(sentences_in_batch * 3)
    assert runner is translator._runners[sentences_in_batch * 3 <= SMALL_ROWS]
    assert candidates == (sentences_in_batch * 3 <= SMALL_ROWS)  # the small package ranks the candidates itself


def test_greedy_compiled_search_equals_the_eager_search(models, tokenizer, sentences, cache_dir):
    translator = AotTranslator(models["plain"], 1, cache_dir=cache_dir, small_rows=0)
    src = _sources(tokenizer, sentences)
    _assert_same(translator.beam_search(src, return_scores=True),
                 beam_search(translator.model, src, beam_size=1, return_scores=True))


def test_the_search_through_onednns_sgemm_equals_the_eager_search(models, tokenizer, sentences, tmp_path,
                                                                   monkeypatch):
    """Every product of the few-rows package through ``nas.export.sgemm``'s shim (the choice on AMD CPUs), whatever
    this CPU: the same tokens and scores as the eager search. Its packages go to a folder of their
    own: in the module's shared cache they are not this CPU's choice, which
    :func:`test_the_packages_multiply_by_weights_without_addmm` checks every package there against (it failed on
    an Intel Xeon when they were there)."""
    from nas.export import aot, sgemm

    if not sgemm.load(tmp_path):
        pytest.skip("no libdnnl.so.3 (pip install 'nas[serve]' installs onednn-cpu-gomp) or no C++ compiler")
    monkeypatch.setattr(aot, "packing", lambda small, beam_size=2, sgemm=False: "sgemm" if small else "none")
    translator = AotTranslator(models["mixed"], 3, cache_dir=tmp_path, small_rows=SMALL_ROWS)
    src = _sources(tokenizer, sentences[:2])
    _assert_same(translator.beam_search(src, return_scores=True),
                 beam_search(translator.model, src, beam_size=3, return_scores=True))
    wrapper = _wrapper(translator.package(True))
    assert wrapper.count("aoti_torch_cpu_dnnl_sgemm(") > 1 and "aoti_torch_cpu_mm_out(" not in wrapper


@pytest.mark.slow  # one package (the encoder's is copied from the module's cache): about 25 s on 2 cores
def test_without_the_top_k_shim_the_package_calls_atens_topk_and_searches_the_same(models, tokenizer, sentences,
                                                                                   cache_dir, tmp_path, monkeypatch):
    """Where no C++ compiler builds ``nas.export.topk``'s shim, the few-rows package ranks with ATen's ``topk``:
    the same tokens and scores as the eager search (its step package in a folder of their own, as above: in the
    module's cache it would not be this machine's choice)."""
    from nas.export import aot

    AotTranslator(models["plain"], 3, cache_dir=cache_dir).encoder()  # compiled by earlier tests, or now
    for encoder in cache_dir.glob("encoder_*.pt2"):  # the encoder has no top-k: the same package either way
        shutil.copy(encoder, tmp_path / encoder.name)
    monkeypatch.setattr(aot, "load_topk", lambda cache_dir: False)
    translator = AotTranslator(models["plain"], 3, cache_dir=tmp_path, small_rows=SMALL_ROWS)
    src = _sources(tokenizer, sentences[:2])
    _assert_same(translator.beam_search(src, return_scores=True),
                 beam_search(translator.model, src, beam_size=3, return_scores=True))
    wrapper = _wrapper(translator.package(True))
    assert "aoti_torch_cpu_topk(" in wrapper and "aoti_torch_cpu_small_topk(" not in wrapper


def test_translate_gives_the_exports_translations(models, sentences, cache_dir):
    translator = AotTranslator(models["plain"], cache_dir=cache_dir, small_rows=SMALL_ROWS)
    assert translator.beam_size == 3  # the export's
    assert translator.translate(sentences + [""]) == load_export(models["plain"]).translate(sentences + [""])


def test_the_package_key_follows_the_products_graph_pass_source(models, monkeypatch):
    """A package compiled with an older ``ProductLayout`` pass (``nas/export/aot_products.py``, split out of
    ``aot.py``) must not be loaded from the cache: the pass's source is part of the key, as ``aot.py``'s is."""
    model = load_export(models["plain"]).model
    arch = model.check_arch(load_export(models["plain"]).arch)
    key = package_key(model, arch, 3, VARIANTS[True])
    read = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes",
                        lambda self: read(self) + (b"# edited" if self.name == "aot_products.py" else b""))
    assert package_key(model, arch, 3, VARIANTS[True]) != key


def test_a_package_is_compiled_once_and_keyed_by_the_weights(models, cache_dir):
    first = AotTranslator(models["plain"], 3, cache_dir=cache_dir, small_rows=SMALL_ROWS)
    first.runner(3)  # compiled by an earlier test of this module, or now
    again = AotTranslator(models["plain"], 3, cache_dir=cache_dir, small_rows=SMALL_ROWS)
    again.runner(3)
    assert again.compile_seconds == {}  # loaded from the cache
    assert again.package(True) == first.package(True)
    model = again.model
    small = VARIANTS[True]
    key = package_key(model, again.arch, 3, small)
    assert package_key(model, again.arch, 4, small) != key
    assert package_key(model, again.arch, 3, VARIANTS[False]) != key
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1.0
    try:
        assert package_key(model, again.arch, 3, small) != key
    finally:
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] -= 1.0


def test_the_packages_multiply_by_weights_without_addmm(models, cache_dir):
    # nas.export.aot_products.ProductLayout ran in every package's compilation: its kernels call ATen's mm, never
    # addmm (the bias is added in Inductor's kernels after the product; tests/export/test_product_layout.py checks
    # the pass)
    translator = AotTranslator(models["plain"], 3, cache_dir=cache_dir, small_rows=SMALL_ROWS)
    translator.runner(3), translator.runner(30), translator.encoder()  # compiled by earlier tests, or now
    packages = sorted(cache_dir.glob("*.pt2"))  # these three, and those of the module's other tests
    assert len(packages) >= 3
    from nas.export.aot_products import PACK_WIDE, packing
    from nas.export import topk
    from nas.export.sgemm import load

    for path in packages:
        wrapper = _wrapper(path)
        beam = int(path.name.split("_")[0][4:]) if path.name.startswith("beam") else 2
        pack = packing(None if path.name.startswith("encoder") else "_small_" in path.name, beam,
                       sgemm=load(cache_dir))  # this CPU's
        if pack == "all":  # oneDNN's products by packed weights (AMD CPUs with AVX-512, without libdnnl)
            assert "aoti_torch_cpu__linear_pointwise(" in wrapper, path
        elif pack == "sgemm":  # oneDNN's sgemm through nas.export.sgemm's shim (AMD CPUs)
            assert wrapper.count("aoti_torch_cpu_dnnl_sgemm(") > 1, path  # the declaration, then the calls
            assert "aoti_torch_cpu_mm_out(" not in wrapper, path
        elif pack == "sgemm-wide":  # the output projection through the shim, if wide enough; the layers MKL's
            wide = translator.model.vocab_size >= PACK_WIDE  # not the test's 300 tokens
            assert (wrapper.count("aoti_torch_cpu_dnnl_sgemm(") > 1) == wide, path
            assert "aoti_torch_cpu_mm_out(" in wrapper, path
        else:
            assert "aoti_torch_cpu_mm_out(" in wrapper, path
        assert "aoti_torch_cpu_addmm_out(" not in wrapper, path
        assert "aoti_torch_cpu_baddbmm_out(" not in wrapper, path  # the cross-attention's mask: added in a kernel
        if "_small_" in path.name and topk.load(cache_dir):  # the candidates' top-k by nas.export.topk's loop
            assert "aoti_torch_cpu_small_topk(" in wrapper and "aoti_torch_cpu_topk(" not in wrapper, path


def test_a_beam_size_below_one_is_refused(models, cache_dir):
    with pytest.raises(ValueError, match="beam_size=0"):
        AotTranslator(models["plain"], 0, cache_dir=cache_dir)


def test_nas_translate_compiled_writes_the_exports_translations(models, sentences, cache_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("NAS_AOT_CACHE", str(cache_dir))  # the packages of the tests above (or compiled now)
    (tmp_path / "in.txt").write_text("".join(s + "\n" for s in sentences), encoding="utf-8")
    out = tmp_path / "out.txt"
    done = CliRunner().invoke(app, ["translate", str(models["plain"]), "--compiled", "-i", str(tmp_path / "in.txt"),
                                    "-o", str(out)])
    assert done.exit_code == 0, done.output
    assert out.read_text(encoding="utf-8").splitlines() == load_export(models["plain"]).translate(sentences)


def test_a_source_longer_than_the_model_reads_is_refused_before_compiling(models, tmp_path):
    translator = AotTranslator(models["plain"], 3, cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match="exceeds max_positions=64"):
        translator.beam_search(torch.ones(1, 65, dtype=torch.long))
    assert not (tmp_path / "cache").exists()  # nothing compiled, nothing written


@pytest.mark.parametrize("vendor, flags, intel, avx512", [
    ("AuthenticAMD", "fpu sse2 avx2 fma f16c", False, False),  # the AVX2-only EPYC
    ("AuthenticAMD", "fpu avx2 avx512f avx512bw avx512_bf16", False, True),
    ("GenuineIntel", "fpu avx2 avx512f avx512_bf16 amx_tile", True, True),
    ("GenuineIntel", "fpu avx2 avx512_vnni_only_lookalike", True, False),  # a flag that merely begins with avx512
])
def test_the_cpu_is_read_from_cpuinfo(monkeypatch, tmp_path, vendor, flags, intel, avx512):
    from nas.export import aot_products as aot

    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\nflags\t\t: {flags}\n\nprocessor\t: 1\n", encoding="utf-8")
    monkeypatch.setattr(aot, "CPUINFO", info)
    assert (aot.intel_cpu(), aot.avx512_cpu()) == (intel, avx512)
    monkeypatch.setattr(aot, "CPUINFO", tmp_path / "missing")  # unreadable: Intel's and AVX-512's choices
    assert (aot.intel_cpu(), aot.avx512_cpu()) == (True, True)


@pytest.mark.parametrize("intel", [True, False])
@pytest.mark.parametrize("avx512", [True, False])
def test_packing_is_chosen_by_cpu_vendor_and_keys_the_package(models, monkeypatch, intel, avx512):
    """Off Intel, the few-rows package packs its wide products (the output projection) and the many-rows one
    every product (oneDNN's packed weights; ``nas.export.aot_products.packing``), and so does the encoder where
    the CPU has AVX-512; on Intel, none. The choice is part of the package key and of the file name's hash, so each
    has its own package."""
    from nas.export import aot_products as aot

    monkeypatch.setattr(aot, "intel_cpu", lambda: intel)
    monkeypatch.setattr(aot, "avx512_cpu", lambda: avx512)
    encoder = "all" if avx512 and not intel else "none"  # MKL's products in the encoder on AVX2-only CPUs
    chosen = [aot.packing(small) for small in (True, False, None)]  # few rows, many rows, the encoder
    assert chosen == (["none"] * 3 if intel else ["wide", "all", encoder])
    assert aot.packing(True, beam_size=1) == "none"  # greedy at few rows: 1 row at batch 1, MKL's faster there
    assert aot.packing(False, beam_size=1) == ("none" if intel else "all")
    # with oneDNN's sgemm loaded (nas.export.sgemm): on AVX2-only AMD CPUs every product of the few-rows package
    # and the output projection of the many-rows one go through it, on AMD CPUs with AVX-512 every product of every
    # package (greedy search's included); on Intel CPUs the choices above
    with_sgemm = [aot.packing(small, sgemm=True) for small in (True, False, None)]
    assert with_sgemm == (chosen if intel else ["sgemm"] * 3 if avx512 else ["sgemm", "sgemm-wide", "none"])
    assert aot.packing(True, beam_size=1, sgemm=True) == ("none" if intel else "sgemm")
    assert aot.sgemm_cpu() == (not intel and torch.backends.mkldnn.is_available())
    translator = AotTranslator(models["plain"], 3, small_rows=SMALL_ROWS)
    keys = {package_key(translator.model, translator.arch, 3, {**VARIANTS[False], "pack": pack}) for pack in aot.PACKING}
    assert len(keys) == len(aot.PACKING)


def _loop_or_skip(cache_dir):
    from nas.export import steploop

    lib = steploop.load(cache_dir)
    if lib is None:
        pytest.skip("no C++ compiler: the few-rows package is called from Python (tested above)")
    return lib


def test_the_step_loop_runs_steps_back_to_back_as_package_calls_fed_by_hand(models, tokenizer, sentences,
                                                                             cache_dir, monkeypatch):
    """``nas.export.steploop.StepLoop.run``: ``budget`` steps in C equal as many ``boxed_run`` calls of the same
    package (``aoti_load_package``'s runner) with the grown history, the continued rows, their scores and the
    state fed back by hand, output for output, bit for bit; the last step's token input comes back too."""
    from nas.export import aot, steploop

    _loop_or_skip(cache_dir)
    translator = AotTranslator(models["plain"], 3, cache_dir=cache_dir, small_rows=SMALL_ROWS)
    captured = []
    step = aot._AotStepper.step

    def capture(self, tokens, scores, banned, at_limit, eos_zero):  # the inputs of the search's first call
        if not captured:
            captured.append([tokens, self.rows, scores, self.ban[tuple(banned.tolist())], torch.tensor(at_limit),
                             self.flags[eos_zero], self.memory, self.src_pad, *self.cross, *self.past])
        return step(self, tokens, scores, banned, at_limit, eos_zero)

    monkeypatch.setattr(aot._AotStepper, "step", capture)
    monkeypatch.setattr(translator, "step_loop", False)
    translator.beam_search(_sources(tokenizer, sentences[:2]), max_len_a=0.0, max_len_b=9, min_len=9)
    inputs, boxed = captured[0], translator.runner(6)[0].loader.boxed_run
    assert not isinstance(translator.runner(6)[0], steploop.StepLoop)
    n_past = len(translator.state)
    loop = steploop.StepLoop(steploop.load(cache_dir), steploop.model_library(translator.package(True)),
                             [(0, 9), (1, 7), (2, 4), *((len(inputs) - n_past + i, 10 + i) for i in range(n_past))],
                             stop=8)
    assert (loop.n_in, loop.n_out) == (len(inputs), 10 + n_past)
    fed, want = list(inputs), None
    for _ in range(4):
        last, want = fed[0], boxed(list(fed))
        fed[:3] = [want[9], want[7], want[4]]
        fed[len(fed) - n_past:] = want[10:]
    steps, got_last, got = loop.run(list(inputs), 4)
    assert steps == 4 and torch.equal(got_last, last) and got_last.shape == (6, 4)  # [n*k, 1 + t] at the 4th step
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(loop(list(inputs)), boxed(list(inputs))))  # one call
    forced = list(inputs)  # sentence 1 at its length limit: only its EOS is left, eos_any is set: the loop stops
    forced[4] = torch.tensor([False, True])  # after the first step, whatever the budget
    steps, got_last, got = loop.run(list(forced), 4)
    assert steps == 1 and bool(got[8]) and torch.equal(got_last, inputs[0])
    assert all(torch.equal(a, b) for a, b in zip(got, boxed(list(forced))))
    with pytest.raises(ValueError, match=f"{len(inputs) - 1} inputs: the package takes {len(inputs)}"):
        loop.run(inputs[:-1], 1)


def test_the_search_through_the_step_loop_equals_one_package_call_a_step(models, tokenizer,
                                                                                          sentences, cache_dir,
                                                                                          monkeypatch):
    """Through the loop, the search runs several steps a call, each call ending at its budget (the step before a
    length limit or the end of ``min_len``) or at a step whose EOS ranks among the first ``k``; the tokens and
    scores are those of one package call a step (the same package, bit for bit), for free and fixed length,
    ``min_len`` and a limit before it, and greedy search. (With these random weights EOS ranks only where a limit
    forces it: the stop before the budget is checked on the package in the test above.)"""
    from nas.export import steploop

    _loop_or_skip(cache_dir)
    calls = []
    run = steploop.StepLoop.run

    def record(self, inputs, budget):
        out = run(self, inputs, budget)
        calls.append((budget, out[0], bool(out[2][8])))
        return out

    monkeypatch.setattr(steploop.StepLoop, "run", record)
    src = _sources(tokenizer, sentences[:2])
    for beam in (3, 1):
        looped = AotTranslator(models["plain"], beam, cache_dir=cache_dir, small_rows=SMALL_ROWS)
        stepped = AotTranslator(models["plain"], beam, cache_dir=cache_dir, small_rows=SMALL_ROWS, step_loop=False)
        for kw in ({}, dict(min_len=3), dict(max_len_a=0.0, max_len_b=9, min_len=9),
                   dict(max_len_a=0.0, max_len_b=4, min_len=9)):
            assert looped.beam_search(src, return_scores=True, **kw) == stepped.beam_search(src, return_scores=True,
                                                                                         **kw), (beam, kw)
        assert isinstance(looped.runner(2 * beam)[0], steploop.StepLoop)
        assert not isinstance(stepped.runner(2 * beam)[0], steploop.StepLoop)
    assert any(steps > 1 for _, steps, _ in calls)  # steps back to back
    assert all(steps == budget or eos for budget, steps, eos in calls) and any(eos for _, _, eos in calls)


def test_without_a_compiler_the_step_loop_is_not_built_and_the_package_runs_from_python(models, tokenizer,
                                                                                      sentences, cache_dir,
                                                                                      tmp_path, monkeypatch):
    from nas.export import aot, steploop

    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(aot, "load_steploop", lambda cache_dir: steploop.load(tmp_path))  # the library's folder
    translator = AotTranslator(models["plain"], 3, cache_dir=cache_dir, small_rows=SMALL_ROWS)
    src = _sources(tokenizer, sentences[:2])
    _assert_same(translator.beam_search(src, return_scores=True),
                 beam_search(translator.model, src, beam_size=3, return_scores=True))
    assert not isinstance(translator._runners[True], steploop.StepLoop)
    assert not list(tmp_path.glob("*.so"))  # nothing built


def test_the_model_library_is_copied_out_of_the_package_once(tmp_path):
    from nas.export.steploop import model_library

    package = tmp_path / "step.pt2"
    with zipfile.ZipFile(package, "w") as z:
        z.writestr("step/data/aotinductor/model/abc.wrapper.so", b"\x7fELF library")
        z.writestr("step/data/aotinductor/model/abc.wrapper.cpp", "// source")
    assert model_library(package) == tmp_path / "step.so"
    assert (tmp_path / "step.so").read_bytes() == b"\x7fELF library"
    (tmp_path / "step.so").write_bytes(b"kept")
    assert model_library(package).read_bytes() == b"kept"  # not copied again
    empty = tmp_path / "empty.pt2"
    with zipfile.ZipFile(empty, "w") as z:
        z.writestr("empty/data/aotinductor/model/abc.wrapper.cpp", "// source")
    with pytest.raises(ValueError, match=r"empty\.pt2: expected one model library"):
        model_library(empty)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.pt2", "step.pt2", "step.so"]  # no temporary left
