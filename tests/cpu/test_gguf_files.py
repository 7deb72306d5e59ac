"""A GGUF file loaded straight from the file (`formats.ggufmodel`): tiny models of llama, qwen2, qwen3 and gemma2
written by the tests as llama.cpp writes them (K-quant linears, a tokenizer and chat template in the metadata).
Config and tokenizer come from the metadata; dense, every tensor equals transformers' own GGUF reading; kept as
stored, its logits on the kernel path are those of the dense forward over the dequantized weights to the kernels'
rounding; speculation is exact on it (greedy == γ=0, batched == alone, chi-square of sampled tokens)."""

from __future__ import annotations

import pathlib
import warnings

import numpy as np
import pytest
import torch
from specserve import SamplingParams, SpeculativeDecoder
from specserve.models import LoadedModel, load_model, load_tokenizer
from specserve.models.families.lean import model_sequence
from specserve.models.formats import ggufmodel, packcache
from specserve.models.formats.gguf import FileEmbedding
from specserve.models.kernels import cpu
from specserve.speculation import rejection

from tests.conftest import batched_and_alone
from tests.cpu.test_exactness import chi_square_pvalue
from tests.gguf_files import CHAT_TEMPLATE, FAMILIES, vocabulary, write_gguf
from tests.reference import reference_probs

TEXT = "the other one is here then the end of it"
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
needs_kernels = pytest.mark.skipif(not cpu.available(), reason="specserve's CPU kernels need AVX-512 bf16 or "
                                   "AVX2+FMA+F16C, and g++")


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path_factory.getbasetemp() / "gguf-cache"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{family: (target file, draft file)}: two files of each family, different seeds, one vocabulary."""
    root = tmp_path_factory.mktemp("gguf-files")
    return {f: (write_gguf(root / f"{f}.gguf", f, seed=0), write_gguf(root / f"{f}-draft.gguf", f, seed=1,
                                                                       embedding="Q8_0")) for f in FAMILIES}


def transformers_reading(path):
    """The dense float32 model transformers makes of the file's tensors (its own GGUF loader, our config)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(ggufmodel.metadata_dir(path)))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert set(missing) <= ({"lm_head.weight"} if config.tie_word_embeddings else set()) and not unexpected
    model.tie_weights()
    return model


def test_a_first_start_reads_several_files_metadata_side_by_side(tmp_path, monkeypatch):
    """`read_metadata`: each file's config and tokenizer from a process of its own, into the cache a load then
    finds (the same directory `metadata_dir` gives)."""
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    paths = [write_gguf(tmp_path / "a.gguf", "qwen2", seed=3), write_gguf(tmp_path / "b.gguf", "llama", seed=4)]
    ggufmodel.read_metadata([*map(str, paths), "ngram"])
    made = sorted((tmp_path / "cache" / "gguf").glob("*/config.json"))
    assert [p.parent.name.split("-")[0] for p in made] == ["a", "b"]
    assert {ggufmodel.metadata_dir(p) for p in paths} == {p.parent for p in made}


def test_metadata_is_read_into_the_same_fields_as_ggufs_own_reader(files, tmp_path):
    """The reader transformers is handed while it reads a file's config and tokenizer: every field (the vocabulary,
    its merges and token types among them) and tensor as gguf's `GGUFReader` builds it, part by part."""
    import gguf

    odd = tmp_path / "arrays.gguf"  # arrays of each element kind, strings empty and not ASCII
    w = gguf.GGUFWriter(str(odd), "llama")
    w.add_array("t.floats", [0.5, -1.25, 3.0])
    w.add_array("t.ints", [-(2 ** 31), 7])
    w.add_array("t.flags", [True, False])
    w.add_array("t.strings", ["", "é", "Ġthe", "a b"])
    w.add_string("t.one", "x")
    w.add_tensor("w", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for path in [files["qwen2"][0], files["gemma2"][1], odd]:
        ours, theirs = ggufmodel._one_view_reader()(str(path)), gguf.GGUFReader(str(path))
        assert type(ours) is not gguf.GGUFReader and list(ours.fields) == list(theirs.fields)
        for name, field in theirs.fields.items():
            mine = ours.fields[name]
            assert (mine.offset, mine.data, mine.types) == (field.offset, field.data, field.types), name
            assert [(p.dtype, p.shape, p.tobytes()) for p in mine.parts] == \
                [(p.dtype.newbyteorder("="), p.shape, p.tobytes()) for p in field.parts], name
        tensors = [[(t.name, t.data.tobytes()) for t in r.tensors] for r in (ours, theirs)]
        assert tensors[0] == tensors[1]
    assert ours.fields["t.strings"].contents() == ["", "é", "Ġthe", "a b"]
    assert ours.fields["t.ints"].contents() == [-(2 ** 31), 7] and ours.fields["t.flags"].contents() == [True, False]


def test_a_metadata_read_hands_transformers_the_one_view_reader_and_puts_ggufs_back(tmp_path, monkeypatch):
    import gguf

    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    stock, read = gguf.GGUFReader, []

    class Counted(ggufmodel._one_view_reader()):
        def __init__(self, path, *args, **kwargs):
            read.append(path)
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(ggufmodel, "_one_view_reader", lambda: Counted)
    path = write_gguf(tmp_path / "m.gguf", "qwen2", seed=5)
    ggufmodel.metadata_dir(path)
    assert read and {pathlib.Path(p) for p in read} == {path}
    assert gguf.GGUFReader is stock


@pytest.mark.parametrize("family", list(FAMILIES))
def test_config_and_tokenizer_come_from_the_files_metadata(files, family):
    path = files[family][0]
    loaded = load_model(str(path), "float32", "cpu")
    config = loaded.model.config
    arch, shape, extra = FAMILIES[family]
    assert config.model_type == arch and config.num_hidden_layers == 2 and config.vocab_size == len(vocabulary())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert head_dim == shape["head_dim"] and config.num_key_value_heads == shape["kv_heads"]
    tied = "head" not in shape
    assert config.tie_word_embeddings == tied
    assert (loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight) == tied
    for key, value in extra.items():
        assert getattr(config, key) == value, key
    tokenizer = load_tokenizer(str(path))
    assert tokenizer.chat_template == CHAT_TEMPLATE
    if family != "gemma2":  # transformers reads a Gemma file's vocabulary as sentencepiece's, as Gemma files carry
        ids = tokenizer(" the other")["input_ids"]
        assert vocabulary()[ids[0]] == "Ġthe" and tokenizer.decode(ids) == " the other"
    assert loaded.eos_ids == {vocabulary().index("<|im_end|>")}
    # the cache holds the metadata's small files, no weights
    cached = list(ggufmodel.metadata_dir(path).iterdir())
    assert {p.name for p in cached} >= {"config.json", "tokenizer.json", "generation_config.json"}
    assert sum(p.stat().st_size for p in cached) < 200_000


@pytest.mark.parametrize("spec", [*FAMILIES, "embedded"])
def test_a_workers_eos_ids_read_from_the_tokenizers_files_are_the_tokenizers(files, spec):
    """A loaded model reads its tokenizer on first use; its end-of-sequence ids, which a worker needs, come from
    the tokenizer's files where they say it plainly, and are then what the tokenizer itself reports."""
    from transformers import AutoTokenizer

    from specserve.models.formats.loading import TokenizerAt, resolve_model_path, tokenizer_eos_id

    path = resolve_model_path(str(files[spec][0]) if spec in FAMILIES else spec)[0]
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    read = tokenizer_eos_id(path)
    assert read == tokenizer.eos_token_id is not None  # the metadata specserve writes from a GGUF file says it
    model = load_model(str(files[spec][0]) if spec in FAMILIES else "embedded", "float32", "cpu").model
    deferred, read_now = LoadedModel(model, TokenizerAt(path), "m"), LoadedModel(model, tokenizer, "m")
    assert deferred.eos_ids == read_now.eos_ids and isinstance(deferred._tokenizer, TokenizerAt)  # not read for it
    assert deferred.tokenizer.eos_token_id == tokenizer.eos_token_id  # read on first use


@pytest.mark.parametrize("family", list(FAMILIES))
def test_dense_every_tensor_is_what_transformers_reads_from_the_file(files, family):
    path = files[family][0]
    ours = load_model(str(path), "float32", "cpu").model.state_dict()
    theirs = transformers_reading(path).state_dict()
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)


@needs_kernels
@pytest.mark.parametrize("family", list(FAMILIES))
def test_kept_as_stored_the_kernel_paths_logits_are_the_dense_forwards(files, family):
    """bf16 activations, int8 per block on the kernels' side (per 256 inputs for 6-bit K-quants, as llama.cpp's
    Q8_K), over logits of spread ~2: within 0.05 on average and 1.5 at worst (a dense bf16 forward of the same
    weights is off by up to ~0.3 alone; Gemma's residual stream, its embedding times 16, and Qwen3's q/k norms on
    these random weights make the outliers; the real Qwen2.5-Coder-1.5B's perplexity is the same either way,
    docs/benchmarks-log.md), while another file's logits are off by ~2."""
    path, other = files[family]
    loaded = load_model(str(path), device="cpu")
    assert loaded.quantization.startswith("gguf-") and loaded.dtype == torch.bfloat16
    assert loaded.model.model.layers[0].mlp.down_proj.weight.numel() == 0  # no dense copy of the linears
    ids = load_tokenizer(str(path))(TEXT)["input_ids"]
    got = model_sequence(loaded.model).feed(ids, keep_logits=len(ids)).float()
    reference = transformers_reading(path)
    # the embedding stays in the file; the rows looked up are the dense table's, in the compute dtype
    embedding = loaded.model.model.embed_tokens
    assert isinstance(embedding, FileEmbedding) and not hasattr(embedding, "weight")
    some = torch.tensor(ids + [0, len(vocabulary()) - 1, ids[0]])
    assert torch.equal(embedding[some], reference.model.embed_tokens.weight[some].bfloat16())
    with torch.inference_mode():
        want = reference(torch.tensor([ids])).logits[0]
        elsewhere = transformers_reading(other)(torch.tensor([ids])).logits[0]
    assert want.std() > 1.0
    error = (got - want).abs()
    assert error.mean() < 0.05 and error.max() < 1.5, (error.mean(), error.max())
    assert (elsewhere - want).abs().mean() > 0.5
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


def test_a_tokenizer_is_read_once_then_unpickled_equal(tmp_path, monkeypatch):
    """The first read of a file's tokenizer saves it; the next unpickles it (transformers does not read the files
    again) and tokenizes, decodes and templates as the fresh one; a changed file or a damaged entry reads afresh."""
    from specserve.models.formats import tokcache

    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "t.gguf", "qwen2", seed=5)
    fresh = load_tokenizer(str(path))
    entries = list((tmp_path / "cache" / "tokenizers").glob("*.pkl"))
    assert len(entries) == 1
    import transformers

    def unread(*args, **kwargs):
        raise AssertionError("read from the files")

    with monkeypatch.context() as m:
        m.setattr(transformers.AutoTokenizer, "from_pretrained", unread)
        again = load_tokenizer(str(path))
    chat = [{"role": "user", "content": TEXT}]
    assert again is not fresh and again(TEXT)["input_ids"] == fresh(TEXT)["input_ids"]
    assert again.decode(fresh(TEXT)["input_ids"]) == fresh.decode(fresh(TEXT)["input_ids"])
    assert again.apply_chat_template(chat, tokenize=False) == fresh.apply_chat_template(chat, tokenize=False)
    assert again.eos_token_id == fresh.eos_token_id and again.chat_template == CHAT_TEMPLATE
    entries[0].write_bytes(b"not a pickle")
    assert load_tokenizer(str(path))(TEXT)["input_ids"] == fresh(TEXT)["input_ids"]  # read again, replaced
    assert entries[0].read_bytes() != b"not a pickle"
    config = ggufmodel.metadata_dir(path) / "tokenizer_config.json"
    config.write_text(config.read_text())  # touched: another key
    load_tokenizer(str(path))
    assert len(list((tmp_path / "cache" / "tokenizers").glob("*.pkl"))) == 2
    monkeypatch.setattr(tokcache, "ENABLED", False)
    with monkeypatch.context() as m:
        m.setattr(transformers.AutoTokenizer, "from_pretrained", unread)
        with pytest.raises(AssertionError, match="read from the files"):
            load_tokenizer(str(path))


@needs_kernels
def test_packed_weights_are_cached_once_and_mapped_by_the_next_load(tmp_path, monkeypatch, capfd):
    """The first load of a file packs it and saves the result; the next maps it (logits bit-equal to the fresh
    load's); another packing of the same file (int4) is an entry of its own; a damaged entry is packed again."""
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "q.gguf", "qwen2", seed=5)
    ids = load_tokenizer(str(path))(TEXT)["input_ids"]

    def load(quantization="auto"):
        loaded = load_model(str(path), device="cpu", quantization=quantization)
        logits = model_sequence(loaded.model).feed(ids, keep_logits=len(ids))
        return logits, loaded.quantization, "mapped from the cache" in capfd.readouterr().err

    fresh, kind, mapped = load()
    entries = list((tmp_path / "cache" / "packed").glob("*.pt"))
    assert not mapped and len(entries) == 1 and kind.startswith("gguf-")
    again, kind_again, mapped = load()
    assert mapped and kind_again == kind and torch.equal(again, fresh)
    int4, int4_kind, mapped = load("int4")
    assert not mapped and int4_kind == "int4-g32" and not torch.equal(int4, fresh)
    assert len(list((tmp_path / "cache" / "packed").glob("*.pt"))) == 2
    assert torch.equal(load("int4")[0], int4)
    entries[0].write_bytes(b"not a cache entry")
    repacked, _, mapped = load()
    assert not mapped and torch.equal(repacked, fresh)
    assert load()[2]  # replaced by a readable one
    # entries of other code or builds: the most recently used kept, up to KEEP of a file and quantization
    for n in range(4):
        (tmp_path / "cache" / "packed" / f"q-gguf-Q4_K-{n:016x}.pt").write_bytes(b"older")
    entries[0].unlink()
    load()
    left = sorted(p.name for p in (tmp_path / "cache" / "packed").glob("q-gguf-*.pt"))
    assert len(left) == packcache.KEEP and entries[0].name in left


@needs_kernels
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_speculation_equals_gamma_0_on_the_kernel_path(files, family):
    """A GGUF target and a GGUF draft of another seed (rejections), kept as stored: every prompt's tokens with
    γ = 1, 3 and auto are its own γ = 0 tokens."""
    target, draft = (str(p) for p in files[family])
    decoder = SpeculativeDecoder(target, draft, gamma=3, draft_lookup=False)
    assert decoder.target.quantization.startswith("gguf-")
    tokenizer = load_tokenizer(target)
    for text in (TEXT, "then the one", "here is the other end"):
        prompt = tokenizer(text)["input_ids"]
        plain = decoder.generate(prompt, GREEDY, max_new_tokens=24, gamma=0)
        for gamma in (1, 3, "auto"):
            spec = decoder.generate(prompt, GREEDY, max_new_tokens=24, gamma=gamma)
            assert spec.token_ids == plain.token_ids, (text, gamma)
        assert decoder.generate(prompt, GREEDY, max_new_tokens=24, gamma=3).stats.drafted > 0


@needs_kernels
def test_a_draft_stored_in_wider_types_is_requantized_to_int4_by_default(files, tmp_path, capsys):
    """A Q8_0 draft (as the 0.5B's Q5_0) becomes an int4 draft at load from the file's values, and says so;
    speculation with it stays exact (greedy == γ = 0); quantization 'gguf' keeps it as stored."""
    from specserve.models.formats.loading import load_draft

    wide = write_gguf(tmp_path / "wide.gguf", "qwen2", seed=1, linears="Q8_0")
    draft = load_draft(str(wide), device="cpu")
    assert draft.quantization == "int4-g32" and "Q8_0 linears requantized to int4" in capsys.readouterr().err
    assert load_draft(str(wide), device="cpu", quantization="gguf").quantization == "gguf-Q8_0"
    assert load_draft(str(files["qwen2"][1]), device="cpu").quantization == "gguf-Q4_K"  # 4 bits: as stored
    target = str(files["qwen2"][0])
    decoder = SpeculativeDecoder(target, str(wide), gamma=3, draft_lookup=False)
    assert decoder.draft.quantization == "int4-g32"
    prompt = load_tokenizer(target)(TEXT)["input_ids"]
    plain = decoder.generate(prompt, GREEDY, max_new_tokens=24, gamma=0)
    spec = decoder.generate(prompt, GREEDY, max_new_tokens=24, gamma=3)
    assert spec.token_ids == plain.token_ids and spec.stats.drafted > 0


@needs_kernels
@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_batched_sessions_on_a_k_quant_target_each_equal_their_run_alone(files, family):
    target = load_model(str(files[family][0]), device="cpu")
    draft = load_model(str(files[family][1]), device="cpu")
    prompt = load_tokenizer(str(files[family][0]))(TEXT)["input_ids"]
    together, alone, shared = batched_and_alone(target.model, draft.model, target.vocab_size, prompt, sessions=5)
    assert shared >= 3, "the sessions did not share steps"
    assert together == alone


MODE = dict(temperature=1.0, top_k=4, top_p=1.0)
CHI_RUNS = 1500


@needs_kernels
def test_sampled_first_tokens_through_a_k_quant_target_follow_its_distribution(files, tmp_path, monkeypatch):
    """Chi-square of the first two sampled tokens (top-k 4: 16 cells or a few more) against the joint distribution
    of the stored target's own forward, one sequence at a time through the decoder's own target cache (its KV
    pool's forward and `model_sequence`'s round differently, logits ~0.05 apart: a few thousand samples see it).
    The draft is the same file with a flatter head (its proposals overlap the target's, so acceptance is partial
    and the residual step matters): a broken sampler (no residual step) must be rejected."""
    target = load_model(str(files["llama"][0]), device="cpu")
    prompt = load_tokenizer(str(files["llama"][0]))(TEXT)["input_ids"]
    flatter = write_gguf(tmp_path / "flatter.gguf", "llama", seed=0, head_reach=0.1)
    decoder = SpeculativeDecoder(target, str(flatter), gamma=2, draft_lookup=False)
    args = (MODE["temperature"], MODE["top_k"], MODE["top_p"])

    def alone(tokens: list[int]) -> np.ndarray:
        sequence = decoder.target_sequence()
        try:
            return reference_probs(sequence.feed(tokens)[-1].double().numpy(), *args)
        finally:
            sequence.release()

    p1 = alone(prompt)
    firsts = np.flatnonzero(p1)
    seconds = {a: alone(prompt + [int(a)]) for a in firsts}
    cells = [(a, b) for a in firsts for b in np.flatnonzero(seconds[a])]
    expected = np.array([p1[a] * seconds[a][b] for a, b in cells])

    def counts() -> np.ndarray:
        found = np.zeros(len(cells))
        for seed in range(CHI_RUNS):
            res = decoder.generate(prompt, SamplingParams(**MODE, seed=seed, ignore_eos=True), 2)
            found[cells.index((res.token_ids[0], res.token_ids[1]))] += 1
        return found

    assert len(cells) >= 16 and expected.min() > 0.001, (len(cells), expected.min())  # (ties at the k-th keep both)
    assert chi_square_pvalue(counts(), expected) > 1e-3
    monkeypatch.setattr(rejection, "residual_distribution", lambda p, q: p)
    assert chi_square_pvalue(counts(), expected) < 1e-3, "the test cannot tell a missing residual step"
