"""Chat format of the demo model and the corpus -> training-sample conversion.

The template is ChatML (as Qwen's): every message is ``<|im_start|>{role}\\n{content}<|im_end|>\\n``
and ``add_generation_prompt`` appends ``<|im_start|>assistant\\n``. The assistant turn ends with
``<|im_end|>``, which is an EOS id of the model alongside ``<|endoftext|>`` (document separator,
padding). ``<|mask|>`` is the drafter's mask token.

Training samples are lists of ``(text, trained)`` segments: the prompt part of a chat sample is
not trained on, the assistant's answer (including ``<|im_end|>``) is; plain continuation samples
are trained on entirely. Segments are tokenized separately, so the prompt is tokenized exactly as
the server tokenizes a rendered chat prompt that ends in ``<|im_start|>assistant\\n``.
"""

from __future__ import annotations

import ast
import functools
import random
import re
from dataclasses import dataclass
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

from dspark_server.training.corpus import Document

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK = "<|mask|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END, MASK)  # ids 0..3 in this order

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@functools.lru_cache(maxsize=1)
def _template() -> Any:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(CHAT_TEMPLATE)


def render_chat(messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
    """Render with the same Jinja settings as Hugging Face and ``dspark_server.models.tokenizer``."""
    return _template().render(messages=messages, add_generation_prompt=add_generation_prompt)


Segment = tuple[str, bool]  # (text, trained)
Sample = list[Segment]


@dataclass(frozen=True)
class SampleConfig:
    max_answer_chars: int = 1800  # longer functions / sections are skipped or cut at a paragraph
    min_answer_chars: int = 60
    max_plain_chars: int = 6000  # plain continuation chunks
    plain_prob: float = 0.35  # chance a document also contributes plain continuation text
    max_chat_per_doc: int = 40


def chat_sample(user: str, answer: str) -> Sample:
    prompt = render_chat([{"role": "user", "content": user}], add_generation_prompt=True)
    return [(prompt, False), (answer + IM_END, True), ("\n" + ENDOFTEXT, False)]


def plain_sample(text: str) -> Sample:
    return [(text, True), (ENDOFTEXT, True)]


# ----------------------------------------------------------------------------------------- code


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    args = ast.unparse(node.args)
    return f"{node.name}({args})"


def _first_sentence(doc: str | None) -> str | None:
    if not doc:
        return None
    para = doc.strip().split("\n\n")[0]
    para = " ".join(para.split())
    m = re.match(r"(.+?[.!?])(\s|$)", para)
    s = m.group(1) if m else para
    if len(s) < 8 or len(s) > 300:
        return None
    return s[0].lower() + s[1:] if s[:2] != s[:2].upper() else s


_CODE_FUNC_PROMPTS = (
    "Write a Python function `{sig}` that {doc}",
    "Write a Python function `{sig}`.",
    "Implement `{name}` in Python. It should {doc}",
    "Write a Python function that {doc}",
    "Show me the Python code for `{sig}`.",
)
_CODE_FUNC_PROMPTS_NODOC = (
    "Write a Python function `{sig}`.",
    "Implement the Python function `{sig}`.",
    "Show me the Python code for `{sig}`.",
)
_CODE_CLASS_PROMPTS = (
    "Write a Python class `{name}` that {doc}",
    "Write a Python class `{name}`.",
    "Implement the class `{name}` from the `{module}` module.",
)
_CODE_MODULE_PROMPTS = (
    "Write the beginning of the Python module `{module}`.",
    "Show me the source of the `{module}` module.",
)


def _answer_code(src: str) -> str:
    return f"```python\n{src}\n```"


def code_samples(doc: Document, rng: random.Random, cfg: SampleConfig = SampleConfig()) -> list[Sample]:
    module = doc.name[:-3].replace("/", ".").removesuffix(".__init__")
    samples: list[Sample] = []
    try:
        tree = ast.parse(doc.text)
    except (SyntaxError, ValueError):
        tree = None
    if tree is not None:
        nodes: list[ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef] = []
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                nodes.append(node)
            if isinstance(node, ast.ClassDef):
                nodes.extend(
                    n
                    for n in node.body
                    if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                    and not (n.name.startswith("__") and n.name != "__init__")
                )
        rng.shuffle(nodes)
        lines = doc.text.splitlines()
        for node in nodes[: cfg.max_chat_per_doc]:
            start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            src = _dedent("\n".join(lines[start - 1 : node.end_lineno]))
            if not cfg.min_answer_chars <= len(src) <= cfg.max_answer_chars:
                continue
            first = _first_sentence(ast.get_docstring(node))
            if isinstance(node, ast.ClassDef):
                choices = _CODE_CLASS_PROMPTS if first else _CODE_CLASS_PROMPTS[1:]
                user = rng.choice(choices).format(name=node.name, doc=first, module=module)
            else:
                fmt = dict(sig=_signature(node), name=node.name, doc=first)
                user = rng.choice(_CODE_FUNC_PROMPTS if first else _CODE_FUNC_PROMPTS_NODOC).format(**fmt)
            samples.append(chat_sample(user, _answer_code(src)))
    head = _cut(doc.text, cfg.max_answer_chars)
    if len(head) >= cfg.min_answer_chars and rng.random() < 0.5:
        user = rng.choice(_CODE_MODULE_PROMPTS).format(module=module)
        samples.append(chat_sample(user, _answer_code(head)))
    if rng.random() < cfg.plain_prob:
        samples.extend(plain_sample(c) for c in _chunks(doc.text, cfg.max_plain_chars))
    return samples


def _dedent(src: str) -> str:
    lines = src.splitlines()
    indent = min((len(line) - len(line.lstrip()) for line in lines if line.strip()), default=0)
    return "\n".join(line[indent:] for line in lines)


# ---------------------------------------------------------------------------------------- prose

_TITLE_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+<>_:.])\1{3,}\s*$")

_PROSE_TITLE_PROMPTS = (
    "Tell me about {title}.",
    "Explain {title}.",
    "What should I know about {title}?",
    "Write a short article about {title}.",
    "Tell me about the history of {title}.",
    "Describe {title} in a few paragraphs.",
)
_PROSE_CONT_PROMPTS = (
    "Continue this text: {first}",
    "Continue writing: {first}",
    "{first}",
)


def split_sections(text: str) -> list[tuple[str, str]]:
    """(title, body) pairs of a cleaned reST document (a title line followed by an underline)."""
    lines = text.splitlines()
    sections: list[tuple[str, list[str]]] = []
    title = ""
    body: list[str] = []
    i = 0
    while i < len(lines):
        if (
            i + 1 < len(lines)
            and lines[i].strip()
            and _TITLE_UNDERLINE.match(lines[i + 1])
            and len(lines[i + 1].strip()) >= len(lines[i].strip()) * 0.6
        ):
            sections.append((title, body))
            title, body = lines[i].strip(), []
            i += 2
            continue
        body.append(lines[i])
        i += 1
    sections.append((title, body))
    return [(t, "\n".join(b).strip()) for t, b in sections if "\n".join(b).strip()]


def _cut(text: str, limit: int) -> str:
    """Cut at a paragraph (or line) boundary at most ``limit`` characters in."""
    if len(text) <= limit:
        return text.rstrip()
    cut = text.rfind("\n\n", 0, limit)
    if cut < limit // 3:
        cut = text.rfind("\n", 0, limit)
    if cut < limit // 3:
        cut = limit
    return text[:cut].rstrip()


def _chunks(text: str, limit: int) -> list[str]:
    out = []
    while text.strip():
        piece = _cut(text, limit)
        out.append(piece)
        text = text[len(piece) :].lstrip("\n")
    return out


def prose_samples(doc: Document, rng: random.Random, cfg: SampleConfig = SampleConfig()) -> list[Sample]:
    samples: list[Sample] = []
    sections = split_sections(doc.text)
    rng_sections = list(sections)
    rng.shuffle(rng_sections)
    for title, body in rng_sections[: cfg.max_chat_per_doc]:
        answer = _cut(body, cfg.max_answer_chars)
        if len(answer) < cfg.min_answer_chars:
            continue
        if title and rng.random() < 0.7:
            user = rng.choice(_PROSE_TITLE_PROMPTS).format(title=title)
            samples.append(chat_sample(user, answer))
        else:
            m = re.match(r"(.{20,300}?[.!?])\s", answer, re.S)
            rest = answer[m.end() :].lstrip() if m else ""
            if m is None or len(rest) < cfg.min_answer_chars:
                continue
            first = " ".join(m.group(1).split())
            user = rng.choice(_PROSE_CONT_PROMPTS).format(first=first)
            samples.append(chat_sample(user, rest))
    if rng.random() < cfg.plain_prob:
        samples.extend(plain_sample(c) for c in _chunks(doc.text, cfg.max_plain_chars))
    return samples


def document_samples(doc: Document, rng: random.Random, cfg: SampleConfig = SampleConfig()) -> list[Sample]:
    if doc.kind == "code":
        return code_samples(doc, rng, cfg)
    return prose_samples(doc, rng, cfg)


def build_samples(docs: list[Document], seed: int = 0, cfg: SampleConfig = SampleConfig()) -> list[Sample]:
    """All samples of a document list, in a seeded shuffled order."""
    rng = random.Random(seed)
    samples: list[Sample] = []
    for d in docs:
        samples.extend(document_samples(d, rng, cfg))
    rng.shuffle(samples)
    return samples
