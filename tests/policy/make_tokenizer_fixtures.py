# Writes the tokenizer and chat-template fixtures into OUT_DIR: a deterministic corpus with the ids and
# decodes of Hugging Face `tokenizers`, and prompts rendered by transformers' apply_chat_template.
#
#   .venv/bin/python tests/policy/make_tokenizer_fixtures.py build/fixtures/tokenizer
#
# What it writes (tests/policy/test_tokenizer.cpp and test_chat_template.cpp read it):
#   qwen3.jsonl, smollm2.jsonl     {"text", "ids", "decoded", "nfc"} per corpus line
#   smollm2_llama_cpp.jsonl        the same for SmolLM2's GGUF as llama.cpp itself tokenizes it
#   smollm2/tokenizer.json         the SmolLM2 reference tokenizer, merges as legacy "a b" strings
#   variants/NAME/tokenizer.json   small pre-tokenizer/normalizer/added-token variants, + NAME.jsonl
#   gguf/*.gguf                    tokenizer-only GGUF files (qwen2 and llama-bpe pre, bad inputs)
#   lossy.json                     byte-token sequences, often invalid UTF-8, with their decodes
#   chat_templates.json            template sources and conversations with the expected prompts
#
# The SmolLM2 reference: transformers' GGUF conversion builds a `tokenizers` fast tokenizer from the
# GGUF's vocab, merges and token types, but gives it plain GPT-2 ByteLevel pre-tokenization, because
# its table has no entry for the file's `tokenizer.ggml.pre = "smollm"`. llama.cpp splits "smollm"
# text with `\p{N}` first and then the GPT-2 regex, which is what SmolLM2's own tokenizer.json does
# with Digits(individual_digits) + ByteLevel. So the reference is transformers' conversion with that
# pre-tokenizer put back; how many lines the unmodified conversion gets wrong is printed.
# Because that reference is patched by hand, the same corpus is also tokenized by llama.cpp
# (llama-cpp-python, vocab only) from the GGUF file itself; lines where it and the patched
# reference disagree are counted and the first few printed.
import json
import random
import sys
import unicodedata
from pathlib import Path

import gguf
from tokenizers import AddedToken, Tokenizer

OUT = Path(sys.argv[1])
OUT.mkdir(parents=True, exist_ok=True)
ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data"
QWEN3_DIR = DATA / "tokenizers" / "qwen3"
MODELS = ROOT / "models"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

rng = random.Random(20240611)


# --- corpus ------------------------------------------------------------------------------------

PYTHON_SNIPPETS = [
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "class Stack:\n\tdef __init__(self):\n\t\tself.items = []\n\n\tdef push(self, x):\n\t\tself.items.append(x)\n",
    "import numpy as np\nx = np.linspace(0.0, 1.0, 101)\ny = x ** 2 - 3 * x + 2.5e-3\nprint(f\"{y.sum():.4f}\")\n",
    "with open('data.txt', 'r', encoding='utf-8') as f:\n    for i, line in enumerate(f):\n        if not line.strip():\n            continue\n        print(i, line.rstrip('\\n'))\n",
    "    # trailing spaces   \n    total = sum(v for k, v in d.items() if k != 'skip')  \n\n\n",
    "@dataclass(frozen=True)\nclass Point:\n    x: float = 0.0\n    y: float = 0.0\n\n    def norm(self) -> float:\n        return (self.x**2 + self.y**2) ** 0.5\n",
    "lambda xs: [x*x for x in xs if x%2==0]  # squares of evens",
    "try:\n    value = int(s)\nexcept ValueError as e:\n    raise RuntimeError(f'bad {s!r}') from e\n",
]

CPP_SNIPPETS = [
    "#include <vector>\n#include <string>\n\nint main(int argc, char** argv) {\n  std::vector<std::string> args(argv, argv + argc);\n  return args.size() > 1 ? 0 : 1;\n}\n",
    "template <typename T>\nT clamp(T v, T lo, T hi) {\n\treturn v < lo ? lo : (hi < v ? hi : v);\n}\n",
    "for (size_t i = 0; i < n; ++i) {\n    acc += a[i] * b[i];  // dot product\n}\n",
    "struct Node { int key; Node* left = nullptr; Node* right = nullptr; };\n",
    "auto it = std::find_if(v.begin(), v.end(), [&](const auto& x) { return x.id == id; });\nif (it == v.end()) throw std::runtime_error(\"not found\");\n",
    "namespace troupe {\n\n// Comment with   three spaces and a tab\there.\nconstexpr double kPi = 3.14159265358979323846;\n\n}  // namespace troupe\n",
    "if(x!=0&&y>=1||z<=-1){return x<<2|y>>1;}else{return ~x^y;}",
    "std::cout << \"Hello, world!\\n\" << std::endl;",
]

CJK = [
    "今天天气很好，我们去公园散步吧。",
    "机器学习是人工智能的一个分支。",
    "東京は日本の首都です。桜がきれいですね！",
    "カタカナとひらがなと漢字を混ぜて書きます。",
    "안녕하세요, 만나서 반갑습니다.",
    "한국어 문장에는 띄어쓰기가 있습니다.",
    "我有3个苹果和12个橘子，一共15个水果。",
    "「こんにちは」と彼は言った。",
    "中文、日本語、한국어が一行に並ぶ。",
    "數學題：一個班有四十二個學生。",
    "Ｆｕｌｌｗｉｄｔｈ　ｔｅｘｔ　ａｎｄ　１２３４５。",
    "𠜎𠜱𠝹𠱓 are CJK Extension B characters.",
]

EMOJI = [
    "I love it 😍😍😍!",
    "Family: 👨‍👩‍👧‍👦 and couple 👩‍❤️‍💋‍👨",
    "Thumbs 👍 👍🏻 👍🏼 👍🏽 👍🏾 👍🏿",
    "Flags: 🇫🇷 🇯🇵 🇺🇸 🏳️‍🌈 🏴‍☠️",
    "Keycaps 1️⃣ 2️⃣ #️⃣ and hearts ❤️ ❤ 💙",
    "Professions: 👩🏽‍💻 🧑🏿‍🚀 👨‍⚕️",
    "🤖🚀✨🔥💯",
    "emoji inside words: pre🙂post and 🎉party🎉",
]

ACCENTED = [
    "café naïve résumé coöperate façade jalapeño",
    "Ångström Øresund Ærø Ñandú Œuvre",
    "Čeština: Příliš žluťoučký kůň úpěl ďábelské ódy.",
    "Tiếng Việt có nhiều dấu: ắ ằ ẳ ẵ ặ ể ộ ữ.",
    "Polski: Zażółć gęślą jaźń.",
    "Français : « Où est la bibliothèque ? » — Là-bas !",
    "Deutsch: Größe, Maße, Straße, Übermäßig.",
    "Ελληνικά: Γειά σου Κόσμε, ῥυθμός ᾄδω.",
    "Русский: Съешь же ещё этих мягких французских булок.",
    "Română: Științe și țări.",
]

COMBINING = [
    "e\u0301 a\u0300 o\u0302 u\u0308 n\u0303 c\u0327",
    "Z\u0351\u036b\u0343a\u0310\u0346l\u0352g\u033co\u036d\u0320",
    "q\u0307\u0323 x\u0338 a\u0308\u0301\u0327",
    "שָׁלוֹם עוֹלָם",
    "العَرَبِيَّة لُغَةٌ جَمِيلَة",
    "हिन्दी में लिखा गया वाक्य।",
    "ภาษาไทยไม่มีการเว้นวรรคระหว่างคำ",
    "ḍ̇ ṩ ǖ ǘ Ǻ",
    "\u0301 starts with a lone combining acute",
]

CONTRACTIONS = [
    "It's what WE'LL do, isn't it? They'Re sure I'M right.",
    "y'all'd've done it; you'D, she'S, he'LL, we'VE, they'RE",
    "don't can't won't shouldn't I'd I've you're",
    "The dog's bone, the dogs' bones, Charles's book.",
    "Curly: it’s, don’t, we’ll — not contractions for GPT-2.",
    "'s 't 're 've 'm 'll 'd at the start",
    "Odd case folding: 'ſ 'K 'ß 'İ",
    "rock 'n' roll, '90s music, 'quoted'",
]

WHITESPACE = [
    "spaces   between    words     here",
    "tabs\tbetween\t\twords\t\t\tand\t end",
    "new\nlines\n\nand\n\n\nmore",
    "mixed \t \n \r\n \n\t  end",
    "windows\r\nline\r\nendings\r\n",
    "   leading and trailing   ",
    "\n\nleading newlines",
    "trailing newlines\n\n\n",
    "nbsp\u00a0here and\u00a0\u00a0two",
    "ideographic\u3000space and en\u2002em\u2003thin\u2009hair\u200a",
    "line\u2028separator and paragraph\u2029separator",
    "next line\u0085NEL and vertical\x0btab and form\x0cfeed",
    "mongolian\u180evowel separator and zero\u200bwidth space",
    "file\x1cgroup\x1drecord\x1eunit\x1fseparators",
    " \u00a0 \u3000 \u2028\n\u0085x",
    "a \u00a0b",
    "a\u0085 b",
    "x\u180e y \u180e\u180ez",
    # U+180E is \s to PCRE2 but not to Oniguruma, which tokenizers uses; these lines tell them apart.
    "  \u180e", " \u180ea", " \u180e.", "\u180e.a", " \n\u180e", "\n\n\u180e", "a  \u180e b \u180e. c",
]

NUMBERS_FIXED = [
    "3.14159265358979323846264338327950288419716939937510",
    "1,234,567,890.12 and -0.000001 and 6.022e23 and 1e-9",
    "Phone: +1 (555) 123-4567, ext. 89",
    "Version 2.10.3-rc1 built on 2024-06-11T10:15:30Z",
    "0x1F 0b1010 0o777 1_000_000",
    "Arabic-Indic ٠١٢٣٤٥٦٧٨٩ Devanagari ०१२३ fullwidth １２３",
    "Superscripts x² y³ fractions ½ ¾ ⅓ Roman Ⅻ circled ①②",
    "12345678901234567890123456789012345678901234567890",
    "$1,000.00 €2.500,50 ¥10000 £3.99 ₹1,00,000",
    "Score 98.6% vs 99.9%; ratio 3:2; 1/3 ≈ 0.333…",
]

SPECIALS_QWEN = [
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "<think>\nLet me think.\n</think>\n\nThe answer is 4.",
    "<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
    "<|im_start|><|im_end|><|endoftext|>",
    "almost special <|im_start and <im_start|> and <|im_end |>",
    "  <|im_start|>  spaces around  <|im_end|>  ",
    "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>",
    "<|vision_start|><|image_pad|><|vision_end|>",
]

SPECIALS_SMOL = [
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM<|im_end|>\n",
    "<file_sep>main.py\n<jupyter_code>print(1)<jupyter_output>1<empty_output>",
    "<repo_name>troupe<filename>a.cpp<gh_stars>100",
    "<issue_start>bug<issue_comment>fixed<issue_closed>",
    "<|endoftext|><|endoftext|>",
]

LONG = [
    "a" * 3000,
    "ab" * 1500,
    "9" * 2000,
    " " * 1000 + "x",
    "\n" * 500,
    "Supercalifragilisticexpialidocious" * 40,
    "🙂" * 300,
    "的" * 1000,
]

EDGE = ["", " ", "\n", "\t", "a", "!", "'", "''", "'s", " 's", "<", "<|", "|>"]


def gsm8k_lines():
    lines = []
    with open(DATA / "gsm8k" / "test.jsonl", encoding="utf-8") as f:
        for i, row in enumerate(f):
            if i >= 700:
                break
            item = json.loads(row)
            lines.append(item["question"])
            if i % 3 == 0:
                lines.append(item["answer"])  # newlines, <<a*b=c>> and "#### 42"
    return lines


def random_number():
    kind = rng.randrange(6)
    if kind == 0:
        return str(rng.randrange(10 ** rng.randrange(1, 25)))
    if kind == 1:
        return f"{rng.uniform(-1e6, 1e6):.{rng.randrange(0, 8)}f}"
    if kind == 2:
        return f"{rng.randrange(10 ** 9):,}"
    if kind == 3:
        return f"{rng.uniform(0, 1):.3e}"
    if kind == 4:
        return "".join(rng.choice("0123456789") for _ in range(rng.randrange(30, 80)))
    return f"{rng.randrange(100)}.{rng.randrange(100)}.{rng.randrange(100)}"


FRAGMENT_POOLS = [CJK, EMOJI, ACCENTED, COMBINING, CONTRACTIONS, WHITESPACE, NUMBERS_FIXED,
                  SPECIALS_QWEN, SPECIALS_SMOL, EDGE]
SEPARATORS = [" ", "  ", "\n", "\t", "", " \n ", "\r\n", "\n\n", "   \t"]


def nfd_variants(lines):
    return [unicodedata.normalize("NFD", s) for s in lines if unicodedata.normalize("NFD", s) != s]


def mixed_line(words):
    parts = []
    for _ in range(rng.randrange(2, 7)):
        choice = rng.randrange(4)
        if choice == 0:
            parts.append(rng.choice(rng.choice(FRAGMENT_POOLS)))
        elif choice == 1:
            parts.append(random_number())
        elif choice == 2:
            parts.append(" ".join(rng.choice(words) for _ in range(rng.randrange(1, 12))))
        else:
            snippet = rng.choice(PYTHON_SNIPPETS + CPP_SNIPPETS)
            lines = snippet.split("\n")
            a = rng.randrange(len(lines))
            parts.append("\n".join(lines[a:a + rng.randrange(1, 4)]))
        parts.append(rng.choice(SEPARATORS))
    return "".join(parts)


def build_corpus():
    lines = []
    lines += gsm8k_lines()
    lines += PYTHON_SNIPPETS + CPP_SNIPPETS
    for snippet in PYTHON_SNIPPETS + CPP_SNIPPETS:
        lines += [l for l in snippet.split("\n") if l]
        lines.append(snippet.replace("    ", "\t"))
    lines += CJK + EMOJI + ACCENTED + COMBINING + CONTRACTIONS + WHITESPACE + NUMBERS_FIXED
    lines += SPECIALS_QWEN + SPECIALS_SMOL + LONG + EDGE
    lines += nfd_variants(ACCENTED + CJK + COMBINING + CONTRACTIONS)
    lines += [random_number() for _ in range(150)]
    words = sorted({w for l in lines[:400] for w in l.split()})
    while len(lines) < 2100:
        lines.append(mixed_line(words))
    return lines


# --- references --------------------------------------------------------------------------------

def write_jsonl(path, tok, lines):
    with open(path, "w", encoding="utf-8") as f:
        for text in lines:
            ids = tok.encode(text, add_special_tokens=False).ids
            decoded = tok.decode(ids, skip_special_tokens=False)
            nfc = unicodedata.normalize("NFC", text) == text
            f.write(json.dumps({"text": text, "ids": ids, "decoded": decoded, "nfc": nfc},
                               ensure_ascii=False) + "\n")


def llama_cpp_detokenize(llm, ids):
    # llama.cpp's own llama_detokenize, special tokens rendered and none removed. Not
    # Llama.detokenize: its 32-byte buffer per token returns nothing for SmolLM2's 64-space token
    # (40686), and it drops a leading space whenever the first id is BOS (here <|im_start|>).
    import ctypes
    import llama_cpp
    tokens = (llama_cpp.llama_token * len(ids))(*ids)
    size = 64 + 8 * len(ids)
    while True:
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_detokenize(llm._model.vocab, tokens, len(ids), buf, size, False, True)
        if n >= 0:
            return buf.raw[:n]
        size = -n


def write_llama_cpp_jsonl(path, lines, hf):
    """llama.cpp's ids for the SmolLM2 GGUF: no BOS, special tokens parsed (as encode does), and
    its detokenization with special tokens kept. Prints where the HF reference differs."""
    from llama_cpp import Llama
    llm = Llama(model_path=str(MODELS / SMOLLM2_GGUF), vocab_only=True, verbose=False)
    id_diffs, decode_diffs = [], []
    with open(path, "w", encoding="utf-8") as f:
        for i, text in enumerate(lines):
            ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True) if text else []
            decoded = llama_cpp_detokenize(llm, ids).decode("utf-8", errors="replace")
            nfc = unicodedata.normalize("NFC", text) == text
            f.write(json.dumps({"text": text, "ids": ids, "decoded": decoded, "nfc": nfc},
                               ensure_ascii=False) + "\n")
            hf_ids = hf.encode(text, add_special_tokens=False).ids
            if hf_ids != ids:
                id_diffs.append((i, text, hf_ids, ids))
            if hf.decode(ids, skip_special_tokens=False) != decoded:
                decode_diffs.append((i, text))
    print(f"llama.cpp vs the smollm reference: {len(id_diffs)} of {len(lines)} lines tokenize "
          f"differently, {len(decode_diffs)} decode differently")
    for i, text, hf_ids, ids in id_diffs[:5]:
        print(f"  line {i + 1}: {text[:80]!r}\n    hf:        {hf_ids[:20]}\n    llama.cpp: {ids[:20]}")
    for i, text in decode_diffs[:5]:
        print(f"  line {i + 1} decodes differently: {text[:80]!r}")


def count_differences(a, b, lines):
    return sum(a.encode(t, add_special_tokens=False).ids != b.encode(t, add_special_tokens=False).ids
               for t in lines)


def smollm2_reference():
    from transformers import AutoTokenizer
    converted = AutoTokenizer.from_pretrained(str(MODELS), gguf_file=SMOLLM2_GGUF).backend_tokenizer
    spec = json.loads(converted.to_str())
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    return converted, spec


def legacy_merges(spec):
    spec = json.loads(json.dumps(spec))
    spec["model"]["merges"] = [" ".join(pair) for pair in spec["model"]["merges"]]
    return spec


def write_tokenizer_json(directory, spec):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")


# Each variant changes one thing the two real tokenizers leave untested; ids come from `tokenizers`.
def variants(smol_spec):
    def with_pre(pre, normalizer=None):
        spec = legacy_merges(smol_spec)
        spec["pre_tokenizer"] = pre
        spec["normalizer"] = normalizer
        return spec

    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    out = {
        "split_removed_prefix_space": with_pre({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\d+"}, "behavior": "Removed", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}]}),
        "split_string_merged_previous": with_pre({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False},
            byte_level]}),
        "split_merged_next": with_pre({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "[,.!?]"}, "behavior": "MergedWithNext", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}),
        "split_contiguous_invert": with_pre({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\p{L}+"}, "behavior": "Contiguous", "invert": True},
            byte_level]}),
        "digits_contiguous_nfc": with_pre({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
            {"type": "Sequence", "normalizers": [{"type": "NFC"}]}),
        "byte_level_alone": with_pre(byte_level),
        # Keeps only runs of \w, which for Oniguruma include marks, all numbers and connector punctuation
        # (PCRE2 10.42's \w leaves marks and most of Pc out).
        "split_word_classes": with_pre({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\w+"}, "behavior": "Removed", "invert": True},
            byte_level]}),
    }
    # ignore_merges, and added tokens with lstrip/rstrip/single_word/normalized, on the Qwen3 base.
    qwen = Tokenizer.from_file(str(QWEN3_DIR / "tokenizer.json"))
    qwen.add_tokens([
        AddedToken("[MASK]", lstrip=True, rstrip=False, normalized=False, special=True),
        AddedToken("<sep>", lstrip=False, rstrip=True, normalized=False, special=False),
        AddedToken("word", single_word=True, normalized=False, special=False),
        AddedToken("café", single_word=False, normalized=True, special=False),
        AddedToken("<sep>x", normalized=False, special=False),
    ])
    spec = json.loads(qwen.to_str())
    spec["model"]["ignore_merges"] = True
    out["qwen3_ignore_merges_added"] = spec
    return out


VARIANT_EXTRA = [
    "a [MASK] b  [MASK]\t[MASK]c", "x<sep>  y<sep>\n\nz<sep>", "<sep>x <sep>xy", "word words sword word_ word.",
    "a word", "word", "café cafe\u0301 cafés", "nai\u0308ve Z\u0351a\u0310 हिन्दी", "a\u203fb c\u2040d x_y x\u00b2y \u2160x", "1 22 333 4444, end. Yes! Really?", "  lead", "trail  ",
]


# Random byte tokens, many of them invalid UTF-8 together: decoding must put U+FFFD where Rust's
# String::from_utf8_lossy does.
def lossy_cases(qwen):
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelling, extra = {}, 0
    for b in range(256):
        spelling[b] = chr(b) if b in printable else chr(256 + extra)
        extra += b not in printable
    interesting = [0x41, 0x20, 0x80, 0x9F, 0xBF, 0xC0, 0xC2, 0xDF, 0xE0, 0xE2, 0xED, 0xEF, 0xF0, 0xF4, 0xF5, 0xFF,
                   0xA0, 0x82, 0xAC, 0x90, 0x8F]
    cases = []
    for _ in range(300):
        seq = [rng.choice(interesting) for _ in range(rng.randrange(1, 10))]
        ids = [qwen.token_to_id(spelling[b]) for b in seq]
        cases.append({"ids": ids, "decoded": qwen.decode(ids, skip_special_tokens=False)})
    return cases


# --- tokenizer-only GGUF files -----------------------------------------------------------------

def write_tokenizer_gguf(path, tokens, types, merges, pre, model="gpt2", eos=None):
    w = gguf.GGUFWriter(str(path), arch="qwen2")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    if eos is not None:
        w.add_eos_token_id(eos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def qwen3_gguf_parts(spec):
    vocab = spec["model"]["vocab"]
    added = {t["id"]: t for t in spec["added_tokens"]}
    size = max(list(vocab.values()) + list(added)) + 1
    tokens, types = [None] * size, [1] * size
    for token, i in vocab.items():
        tokens[i] = token
    for i, t in added.items():
        tokens[i] = t["content"]
        types[i] = 3 if t["special"] else 4
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    return tokens, types, merges


def write_ggufs(qwen_spec, lines):
    d = OUT / "gguf"
    d.mkdir(exist_ok=True)
    tokens, types, merges = qwen3_gguf_parts(qwen_spec)
    eos = tokens.index("<|im_end|>")
    write_tokenizer_gguf(d / "qwen2_pre.gguf", tokens, types, merges, "qwen2", eos=eos)
    write_tokenizer_gguf(d / "llama_bpe_pre.gguf", tokens, types, merges, "llama-bpe", eos=eos)
    # The llama-bpe reference: the same vocabulary with Llama-3's split regex and no normalizer.
    from transformers.integrations.gguf.gguf_tokenizer_mapping import _LLAMA3_SPLIT
    llama = json.loads(json.dumps(qwen_spec))
    llama["normalizer"] = None
    llama["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = _LLAMA3_SPLIT
    write_jsonl(OUT / "llama_bpe_pre.jsonl", Tokenizer.from_str(json.dumps(llama)), lines)

    tiny = ["a", "b", "ab", "<|end|>"]
    write_tokenizer_gguf(d / "bad_pre.gguf", tiny, [1, 1, 1, 3], ["a b"], "deepseek-llm")
    write_tokenizer_gguf(d / "bad_model.gguf", tiny, [1, 1, 1, 3], None, None, model="llama")
    write_tokenizer_gguf(d / "bad_merge.gguf", tiny, [1, 1, 1, 3], ["a c"], "smollm")


# --- chat templates ----------------------------------------------------------------------------

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

LLAMA31_TEMPLATE = (
    "{{- bos_token }}\n{%- if custom_tools is defined %}\n    {%- set tools = custom_tools %}\n{%- endif %}\n"
    "{%- if not tools_in_user_message is defined %}\n    {%- set tools_in_user_message = true %}\n{%- endif %}\n"
    "{%- if not date_string is defined %}\n    {%- set date_string = \"26 Jul 2024\" %}\n{%- endif %}\n"
    "{%- if not tools is defined %}\n    {%- set tools = none %}\n{%- endif %}\n\n"
    "{#- This block extracts the system message, so we can slot it into the right place. #}\n"
    "{%- if messages[0]['role'] == 'system' %}\n    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n{%- else %}\n    {%- set system_message = \"\" %}\n{%- endif %}\n\n"
    "{#- System message + builtin tools #}\n{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n"
    "{%- if builtin_tools is defined or tools is not none %}\n    {{- \"Environment: ipython\\n\" }}\n{%- endif %}\n"
    "{%- if builtin_tools is defined %}\n"
    "    {{- \"Tools: \" + builtin_tools | reject('equalto', 'code_interpreter') | join(\", \") + \"\\n\\n\"}}\n"
    "{%- endif %}\n{{- \"Cutting Knowledge Date: December 2023\\n\" }}\n"
    "{{- \"Today Date: \" + date_string + \"\\n\\n\" }}\n"
    "{%- if tools is not none and not tools_in_user_message %}\n"
    "    {{- \"You have access to the following functions. To call a function, please respond with JSON for a function call.\" }}\n"
    "    {{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.' }}\n"
    "    {{- \"Do not use variables.\\n\\n\" }}\n    {%- for t in tools %}\n        {{- t | tojson(indent=4) }}\n"
    "        {{- \"\\n\\n\" }}\n    {%- endfor %}\n{%- endif %}\n{{- system_message }}\n{{- \"<|eot_id|>\" }}\n\n"
    "{#- Custom tools are passed in a user message with some extra guidance #}\n"
    "{%- if tools_in_user_message and not tools is none %}\n"
    "    {#- Extract the first user message so we can plug it in here #}\n    {%- if messages | length != 0 %}\n"
    "        {%- set first_user_message = messages[0]['content']|trim %}\n        {%- set messages = messages[1:] %}\n"
    "    {%- else %}\n"
    "        {{- raise_exception(\"Cannot put tools in the first user message when there's no first user message!\") }}\n"
    "{%- endif %}\n    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}\n"
    "    {{- \"Given the following functions, please respond with a JSON for a function call \" }}\n"
    "    {{- \"with its proper arguments that best answers the given prompt.\\n\\n\" }}\n"
    "    {{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.' }}\n"
    "    {{- \"Do not use variables.\\n\\n\" }}\n    {%- for t in tools %}\n        {{- t | tojson(indent=4) }}\n"
    "        {{- \"\\n\\n\" }}\n    {%- endfor %}\n    {{- first_user_message + \"<|eot_id|>\"}}\n{%- endif %}\n\n"
    "{%- for message in messages %}\n"
    "    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}\n"
    "        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}\n"
    "    {%- elif 'tool_calls' in message %}\n        {%- if not message.tool_calls|length == 1 %}\n"
    "            {{- raise_exception(\"This model only supports single tool-calls at once!\") }}\n        {%- endif %}\n"
    "        {%- set tool_call = message.tool_calls[0].function %}\n"
    "        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}\n"
    "            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
    "            {{- \"<|python_tag|>\" + tool_call.name + \".call(\" }}\n"
    "            {%- for arg_name, arg_val in tool_call.arguments | items %}\n"
    "                {{- arg_name + '=\"' + arg_val + '\"' }}\n                {%- if not loop.last %}\n"
    "                    {{- \", \" }}\n                {%- endif %}\n                {%- endfor %}\n"
    "            {{- \")\" }}\n        {%- else  %}\n"
    "            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
    "            {{- '{\"name\": \"' + tool_call.name + '\", ' }}\n            {{- '\"parameters\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n            {{- \"}\" }}\n        {%- endif %}\n"
    "        {%- if builtin_tools is defined %}\n            {#- This means we're in ipython mode #}\n"
    "            {{- \"<|eom_id|>\" }}\n        {%- else %}\n            {{- \"<|eot_id|>\" }}\n        {%- endif %}\n"
    "    {%- elif message.role == \"tool\" or message.role == \"ipython\" %}\n"
    "        {{- \"<|start_header_id|>ipython<|end_header_id|>\\n\\n\" }}\n"
    "        {%- if message.content is mapping or message.content is iterable %}\n"
    "            {{- message.content | tojson }}\n        {%- else %}\n            {{- message.content }}\n"
    "        {%- endif %}\n        {{- \"<|eot_id|>\" }}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n{%- endif %}\n"
)

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "One"},
     {"role": "assistant", "content": "Two"}, {"role": "user", "content": "Three"}],
    [{"role": "user", "content": "  padded question  \n"}, {"role": "assistant", "content": "\n\n  padded answer \n\n"},
     {"role": "user", "content": "\tTabbed\t"}],
    [{"role": "system", "content": "\n System with newlines \n"}, {"role": "user", "content": "multi\nline\n\ntext"}],
    [{"role": "user", "content": "Solve it"}, {"role": "assistant", "content": "<think>\nsteps here\n</think>\n\nThe answer is 5."}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
     {"role": "assistant", "content": "d"}],
    [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "<think>r1</think>a1"},
     {"role": "user", "content": "q2"}, {"role": "assistant", "content": "\n\na2 with leading newlines"}],
    [{"role": "user", "content": "<tool_response>\nok\n</tool_response>"}],
    [{"role": "user", "content": "first"}, {"role": "user", "content": "<tool_response>x</tool_response>"},
     {"role": "assistant", "content": "after tool"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "system", "content": "S2"},
     {"role": "user", "content": "U2"}],
    [{"role": "user", "content": "Unicode: café 😍 你好"}, {"role": "assistant", "content": ""}],
    [{"role": "assistant", "content": "I speak first"}],
]


def chat_cases():
    from transformers import AutoTokenizer
    from transformers.utils.chat_template_utils import render_jinja_template

    qwen = AutoTokenizer.from_pretrained(str(QWEN3_DIR))
    smol = AutoTokenizer.from_pretrained(str(MODELS), gguf_file=SMOLLM2_GGUF)
    templates = [
        ("qwen3", str(QWEN3_DIR / "tokenizer_config.json"), qwen.chat_template,
         lambda msgs, gen: qwen.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)),
        ("smollm2", f"{SMOLLM2_GGUF}:tokenizer.chat_template", smol.chat_template,
         lambda msgs, gen: smol.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)),
    ]
    for name, source in (("llama3", LLAMA3_TEMPLATE), ("llama31", LLAMA31_TEMPLATE), ("qwen25", QWEN25_TEMPLATE),
                         ("chatml", CHATML_TEMPLATE)):
        templates.append((name, f"<{name} template in make_tokenizer_fixtures.py>", source,
                          lambda msgs, gen, source=source: render_jinja_template(
                              [msgs], chat_template=source, add_generation_prompt=gen,
                              bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")[0][0]))
    out = []
    for name, origin, source, render in templates:
        cases = []
        for msgs in CONVERSATIONS:
            for gen in (False, True):
                cases.append({"messages": msgs, "add_generation_prompt": gen, "expected": render(msgs, gen)})
        out.append({"name": name, "origin": origin, "source": source, "cases": cases})
    return out


def main():
    lines = build_corpus()
    qwen = Tokenizer.from_file(str(QWEN3_DIR / "tokenizer.json"))
    write_jsonl(OUT / "qwen3.jsonl", qwen, lines)
    (OUT / "lossy.json").write_text(json.dumps(lossy_cases(qwen)), encoding="utf-8")

    converted, smol_spec = smollm2_reference()
    smol = Tokenizer.from_str(json.dumps(smol_spec))
    write_jsonl(OUT / "smollm2.jsonl", smol, lines)
    write_tokenizer_json(OUT / "smollm2", legacy_merges(smol_spec))
    write_llama_cpp_jsonl(OUT / "smollm2_llama_cpp.jsonl", lines, smol)
    print(f"{len(lines)} corpus lines; transformers' GGUF conversion without Digits differs from the "
          f"smollm reference on {count_differences(converted, smol, lines)} of them")

    subset = lines[::7] + VARIANT_EXTRA
    for name, spec in variants(smol_spec).items():
        write_tokenizer_json(OUT / "variants" / name, spec)
        write_jsonl(OUT / "variants" / f"{name}.jsonl", Tokenizer.from_str(json.dumps(spec)), subset)

    write_ggufs(json.loads(qwen.to_str()), lines)
    (OUT / "chat_templates.json").write_text(json.dumps(chat_cases(), ensure_ascii=False, indent=1),
                                            encoding="utf-8")


if __name__ == "__main__":
    main()
