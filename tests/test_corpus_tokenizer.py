"""Demo corpus, chat format and tokenizer training (fast: tiny synthetic inputs)."""

from __future__ import annotations

import json
import random

import pytest

from dspark_server.models.tokenizer import Tokenizer
from dspark_server.training.chat_format import (
    CHAT_TEMPLATE,
    IM_END,
    SPECIAL_TOKENS,
    code_samples,
    prose_samples,
    render_chat,
)
from dspark_server.training.corpus import (
    Document,
    clean_rest,
    dedupe,
    is_heldout,
    iter_code_documents,
    split_documents,
)
from dspark_server.training.tokenizer_train import (
    save_tokenizer,
    special_token_ids,
    train_tokenizer_from_texts,
)

TEXTS = [
    "def read_file(path):\n    with open(path) as f:\n        return f.read()\n",
    "The Python standard library is very extensive, offering a wide range of facilities.\n",
    "class Queue:\n    def __init__(self):\n        self.items = []\n",
] * 20

CONVERSATION = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Write code."},
]
EXPECTED = (
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
    "<|im_start|>user\nWrite code.<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tok = train_tokenizer_from_texts(TEXTS, vocab_size=400, min_frequency=2)
    save_tokenizer(tok, d)
    return d


def test_chat_template_two_turns_with_generation_prompt(tok_dir):
    assert render_chat(CONVERSATION, add_generation_prompt=True) == EXPECTED
    assert render_chat(CONVERSATION[:2]) == EXPECTED[: EXPECTED.index("<|im_start|>user\nWrite")]
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == CHAT_TEMPLATE and cfg["bos_token"] is None
    assert cfg["eos_token"] == "<|endoftext|>" and cfg["pad_token"] == "<|endoftext|>"
    # the server's tokenizer renders the stored template identically
    assert Tokenizer(tok_dir).apply_chat_template(CONVERSATION, add_generation_prompt=True) == EXPECTED


def test_tokenizer_roundtrips_utf8_and_special_tokens(tok_dir):
    tok = Tokenizer(tok_dir)
    for text in [
        "héllo wörld",
        "emoji 😀🚀 and CJK 漢字かな한국어",
        "tabs\tand\nnewlines  \r\n",
        "\x00\x7f odd bytes \u200b\ufeff",
        "def f(x):\n    return x ** 2  # ✓",
    ]:
        assert tok.decode(tok.encode(text)) == text
    ids = special_token_ids(train_tokenizer_from_texts(TEXTS, vocab_size=400))
    assert sorted(ids) == sorted(SPECIAL_TOKENS)
    for name in SPECIAL_TOKENS:
        assert tok.encode(name) == [ids[name]]  # a single id, never split
    rendered = tok.encode(EXPECTED)
    assert rendered.count(ids["<|im_start|>"]) == 4 and rendered.count(ids[IM_END]) == 3
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert {v["content"] for v in cfg["added_tokens_decoder"].values()} == set(SPECIAL_TOKENS)


def test_transformers_autotokenizer_loads(tok_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    assert hf.eos_token == "<|endoftext|>" and hf.pad_token == "<|endoftext|>"
    assert hf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True) == EXPECTED
    text = "naïve 😀 漢字"
    assert hf.decode(hf.encode(text, add_special_tokens=False)) == text
    assert hf.encode(text, add_special_tokens=False) == Tokenizer(tok_dir).encode(text)


def test_split_is_deterministic_and_disjoint():
    docs = [
        Document("code" if i % 2 else "prose", f"f{i}.py", f"document number {i}\n" * 3) for i in range(2000)
    ]
    train1, held1 = split_documents(docs, 0.03)
    train2, held2 = split_documents(list(reversed(docs)), 0.03)
    assert {d.name for d in held1} == {d.name for d in held2}
    assert {d.name for d in train1}.isdisjoint({d.name for d in held1})
    assert len(train1) + len(held1) == len(docs)
    assert 20 <= len(held1) <= 110  # ~3 %
    # the split depends on content only
    assert is_heldout(held1[0], 0.03) and is_heldout(Document("x", "other", held1[0].text), 0.03)
    assert not split_documents(docs, 0.0)[1] and not split_documents(docs, 1.0)[0]


def test_code_collection_skips_tests_and_dedupes(tmp_path):
    body = "def f():\n    return 1\n" * 20
    (tmp_path / "pkg" / "tests").mkdir(parents=True)
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "a.py").write_text(body)
    (tmp_path / "pkg" / "b.py").write_text(body)  # duplicate content
    (tmp_path / "pkg" / "c.py").write_text(body + "x = 2\n")
    (tmp_path / "pkg" / "tests" / "t.py").write_text(body + "y = 3\n")
    (tmp_path / "site-packages" / "s.py").write_text(body + "z = 4\n")
    (tmp_path / "test_x.py").write_text(body + "w = 5\n")
    names = [d.name for d in dedupe(iter_code_documents(tmp_path))]
    assert names == ["a.py", "pkg/c.py"]


def test_samples_mask_prompt_and_train_answer():
    src = (
        'def read_file(path):\n    """Return the text of a file."""\n'
        "    with open(path) as f:\n        return f.read()\n\n\n"
        'class Box:\n    """Hold one value."""\n\n    def __init__(self, v):\n        self.v = v\n'
    )
    samples = code_samples(Document("code", "pkg/io.py", src), random.Random(0))
    chats = [s for s in samples if s[0][0].startswith("<|im_start|>user\n")]
    assert chats
    for s in chats:
        (prompt, p_train), (answer, a_train) = s[0], s[1]
        assert not p_train and a_train
        assert prompt.endswith("<|im_start|>assistant\n") and answer.endswith(IM_END)
        assert answer.startswith("```python\n")
    assert any("def read_file(path):" in s[1][0] for s in chats)
    prose = clean_rest(
        "Title\n=====\n\nSee :func:`open` and ``x``. The file is read in one go.\n"
        "More text follows here so that the section is long enough to be used.\n"
    )
    assert ":func:" not in prose and "``" not in prose
    psamples = prose_samples(Document("prose", "a.rst.txt", prose), random.Random(1))
    assert psamples and all(s[1][1] for s in psamples)
