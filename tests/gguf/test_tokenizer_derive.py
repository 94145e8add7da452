"""The tokenizer fastcomm-serve derives from a GGUF vocabulary: transformers' converter where the installed
release has one for the file's pre-tokenizer, else fastcomm's own byte-level BPE build; both give the same ids."""
from __future__ import annotations

import pytest

from conftest import installed

pytestmark = pytest.mark.skipif(not (installed("gguf") and installed("tokenizers") and installed("transformers")),
                                reason="needs gguf, tokenizers and transformers")

TEXTS = ["hello world", "Hello, World! 12345 67", "  leading and trailing  ", "line\nbreaks\r\n\n  tabs\t\tend",
         "don't you're we'll I'M", "naïve café 東京 — ünïcödé 🙂", "<|user|>hi<|assistant|>there<|endoftext|>",
         "x=3.14159;y=[1,2,3]", "<think>reason</think> done", ""]
CORPUS = [t for t in TEXTS if t] * 20 + ["the quick brown fox jumps over the lazy dog"] * 50


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory):
    """A GGUF holding a real byte-level BPE vocabulary (trained here on a small corpus, so merges matter),
    GLM-5's pre-tokenizer name, control tokens and one user-defined token."""
    import gguf
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    data = tok.to_str()
    import json

    model = json.loads(data)["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    specials, user = ["<|endoftext|>", "<|user|>", "<|assistant|>"], ["<think>", "</think>"]
    tokens += specials + user
    types = [1] * len(vocab) + [3] * len(specials) + [4] * len(user)
    path = tmp_path_factory.mktemp("vocab") / "vocab.gguf"
    w = gguf.GGUFWriter(str(path), "glm-dsa")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("glm4")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|endoftext|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_chat_template("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _meta(path):
    from fastcomm_vllm.gguf import files, metadata

    return metadata.read(files.discover(str(path)))


def _load(folder):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(folder))


def _own(meta, folder, monkeypatch):
    """The folder written with transformers' converter out of reach, as on a release without it."""
    from fastcomm_vllm.gguf import derive

    def no_converter(meta):
        raise ImportError("no transformers.integrations.gguf")

    with monkeypatch.context() as m:
        m.setattr(derive, "_with_transformers", no_converter)
        return derive.write_tokenizer(meta, folder)


def test_own_build_keeps_specials_whole_and_round_trips(vocab_file, tmp_path, monkeypatch):
    meta = _meta(vocab_file)
    note = _own(meta, tmp_path, monkeypatch)
    assert note.startswith("derived") and "built with tokenizers" in note, note
    tok = _load(tmp_path)
    tokens = [str(t) for t in __import__("fastcomm_vllm.gguf.metadata", fromlist=["value"]).value(
        meta, "tokenizer.ggml.tokens")]
    ids = tok("<|user|>hi<think>x</think><|endoftext|>", add_special_tokens=False).input_ids
    for special in ("<|user|>", "<think>", "</think>", "<|endoftext|>"):
        assert tokens.index(special) in ids, special
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|endoftext|>"
    assert tok.chat_template and "messages" in tok.chat_template
    for text in TEXTS:
        assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text
    # merges are applied: a common word is fewer tokens than its bytes
    assert len(tok("the quick brown fox", add_special_tokens=False).input_ids) < len("the quick brown fox") // 2


def test_own_build_matches_transformers_converter(vocab_file, tmp_path, monkeypatch):
    pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping",
                        reason="this transformers has no GGUF tokenizer converter to compare with")
    from fastcomm_vllm.gguf import derive

    meta = _meta(vocab_file)
    theirs_dir, ours_dir = tmp_path / "theirs", tmp_path / "ours"
    theirs_dir.mkdir(), ours_dir.mkdir()
    note = derive.write_tokenizer(meta, theirs_dir)
    assert note.startswith("derived") and "built with tokenizers" not in note, note
    assert "built with tokenizers" in _own(meta, ours_dir, monkeypatch)
    theirs, ours = _load(theirs_dir), _load(ours_dir)
    assert len(theirs) == len(ours)
    for text in TEXTS:
        assert ours(text).input_ids == theirs(text).input_ids, text
        assert ours.decode(ours(text).input_ids) == theirs.decode(theirs(text).input_ids)
    assert (ours.eos_token, ours.pad_token, ours.bos_token) == (theirs.eos_token, theirs.pad_token, theirs.bos_token)


def test_unknown_pre_tokenizer_is_refused_in_words(vocab_file, monkeypatch):
    from fastcomm_vllm.gguf import derive

    meta = _meta(vocab_file)
    fields = {**meta.fields, "tokenizer.ggml.pre": "some-new-pre"}
    odd = type(meta)(files=meta.files, fields=fields, tensors=meta.tensors)
    backend, _, _, how = derive._byte_level_bpe(odd)
    assert backend is None and "some-new-pre" in how and "newer transformers" in how


def test_a_converter_that_does_not_know_the_vocabulary_falls_back_to_the_own_build(vocab_file, tmp_path, monkeypatch):
    from fastcomm_vllm.gguf import derive

    def unknown(meta):
        raise KeyError("glm4")  # a transformers whose converter has no builder for this file

    monkeypatch.setattr(derive, "_with_transformers", unknown)
    assert "built with tokenizers" in derive.write_tokenizer(_meta(vocab_file), tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
