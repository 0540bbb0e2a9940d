"""troupe serve as the official OpenAI client streams from it, and /metrics as Prometheus reads it.

Usage: check_openai_stream.py BASE_URL API_KEY MODEL. Prints one line per check and exits
non-zero at the first failure. Every wait is bounded. The server must serve nothing else meanwhile:
the counter checks compare /metrics before and after this script's own requests.
"""
import sys
import time
import urllib.request

import openai
from prometheus_client.parser import text_string_to_metric_families

base, api_key, model = sys.argv[1:4]
client = openai.OpenAI(base_url=base + "/v1", api_key=api_key, timeout=120, max_retries=0)
PROMPT = "The three primary colors are"
CHAT = [{"role": "user", "content": "Name three colors."}]
sent = {"requests": 0, "choices": 0, "prompt_tokens": 0, "completion_tokens": 0}


def check(ok, what):
    if not ok:
        print("FAIL:", what)
        sys.exit(1)
    print("ok:", what)


def metrics():
    req = urllib.request.Request(base + "/metrics", headers={"Authorization": "Bearer " + api_key})
    with urllib.request.urlopen(req, timeout=30) as r:
        check(r.headers.get("Content-Type", "").startswith("text/plain"), "/metrics is text/plain")
        text = r.read().decode()
    out, unlabelled = {}, []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("model_name") != model:
                unlabelled.append(s.name)
            key = s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[key] = s.value
    check(not unlabelled, f"every sample is labelled model_name={model} (not: {unlabelled})")
    return out


def count(usage, choices):
    sent["requests"] += 1
    sent["choices"] += choices
    sent["prompt_tokens"] += usage.prompt_tokens
    sent["completion_tokens"] += usage.completion_tokens


before = metrics()
check(before["vllm:num_requests_running"] == 0, "no request running at the start")

# Chat: streamed deltas add up to the answer without stream; usage only in the last chunk.
plain = client.chat.completions.create(model=model, messages=CHAT, max_tokens=24, temperature=0)
count(plain.usage, 1)
chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=24, temperature=0, stream=True,
                                             stream_options={"include_usage": True}))
check(chunks[0].choices[0].delta.role == "assistant", "chat: the first delta says role assistant")
text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
check(text == plain.choices[0].message.content, f"chat: streamed text equals the plain answer ({text!r})")
finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
check(finishes == [plain.choices[0].finish_reason], f"chat: one finish_reason, as without stream ({finishes})")
check(chunks[-1].choices == [] and chunks[-1].usage is not None, "chat: the last chunk has no choices and the usage")
check(all(c.usage is None for c in chunks[:-1]), "chat: no other chunk has a usage")
check(chunks[-1].usage.completion_tokens == plain.usage.completion_tokens and
      chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens, f"chat: usage equals the plain answer's ({chunks[-1].usage})")
check(len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk", "chat: one id, object chat.completion.chunk")
count(chunks[-1].usage, 1)

# Completions, greedy with log-probs: same text and the same log-probs token by token.
plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=1)
count(plain.usage, 1)
chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=1, stream=True,
                                        stream_options={"include_usage": True}))
text = "".join(c.choices[0].text for c in chunks if c.choices)
check(text == plain.choices[0].text, f"completions: streamed text equals the plain answer ({text!r})")
streamed_lp = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
plain_lp = plain.choices[0].logprobs.token_logprobs
check(len(streamed_lp) == len(plain_lp) and all(abs(a - b) < 1e-4 for a, b in zip(streamed_lp, plain_lp)),
      f"completions: {len(streamed_lp)} streamed log-probs equal the plain ones to 1e-4")
offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
check(offsets == plain.choices[0].logprobs.text_offset, "completions: text offsets run on across chunks")
count(chunks[-1].usage, 1)

# n samples with a seed: each index streams what the plain request samples at that index.
kw = dict(model=model, prompt=PROMPT, max_tokens=20, temperature=1.0, n=3, seed=7)
plain = client.completions.create(**kw)
count(plain.usage, 3)
texts, finished = {}, {}
for c in client.completions.create(stream=True, **kw):
    for ch in c.choices:
        texts[ch.index] = texts.get(ch.index, "") + ch.text
        if ch.finish_reason:
            finished[ch.index] = finished.get(ch.index, 0) + 1
check(texts == {ch.index: ch.text for ch in plain.choices}, "n=3 seeded: every index streams the plain sample")
check(finished == {0: 1, 1: 1, 2: 1}, "n=3 seeded: one finish_reason per choice")
count(plain.usage, 3)  # same tokens as the plain request (no include_usage asked here)

# A stop string that spans tokens: the stream holds back what may begin it, and ends where the plain answer ends.
full = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
count(full.usage, 1)
words = full.choices[0].text.split()
stop = " ".join(words[2:4]) if len(words) >= 4 else words[-1]
plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
count(plain.usage, 1)
chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop], stream=True))
text = "".join(c.choices[0].text for c in chunks if c.choices)
check(plain.choices[0].finish_reason == "stop" and text == plain.choices[0].text and stop not in text,
      f"stop {stop!r}: streamed text {text!r} equals the plain answer, cut before the stop string")
count(plain.usage, 1)

mid = metrics()
delta = lambda m, key: m.get(key, 0) - before.get(key, 0)
success = sum(delta(mid, "vllm:request_success_total|finished_reason=" + r) for r in ("stop", "length", "abort"))
check(delta(mid, "vllm:prompt_tokens_total") == sent["prompt_tokens"],
      f"prompt_tokens_total rose by the prompts' tokens ({sent['prompt_tokens']})")
check(delta(mid, "vllm:generation_tokens_total") == sent["completion_tokens"],
      f"generation_tokens_total rose by the completions' tokens ({sent['completion_tokens']})")
check(success == sent["choices"], f"request_success_total rose by the choices answered ({sent['choices']})")
check(delta(mid, "vllm:time_to_first_token_seconds_count") == sent["requests"] and
      delta(mid, "vllm:e2e_request_latency_seconds_count") == sent["requests"],
      f"one time-to-first-token and one end-to-end latency per request ({sent['requests']})")
check(delta(mid, "vllm:inter_token_latency_seconds_count") == sent["completion_tokens"] - sent["choices"],
      "one inter-token latency per token after each choice's first")
check(mid["vllm:time_to_first_token_seconds_bucket|le=+Inf"] == mid["vllm:time_to_first_token_seconds_count"],
      "the +Inf bucket holds every observation")
check(mid["vllm:num_requests_running"] == 0 and mid["vllm:num_requests_waiting"] == 0, "nothing running or waiting after")

# A client that goes away mid-stream: its request is aborted and its slot freed.
stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=64, temperature=0, stream=True,
                                   extra_body={"ignore_eos": True})
got = 0
for c in stream:
    got += 1
    if got == 3:
        break
during = metrics()
check(during["vllm:num_requests_running"] == 1, "while it streams, one request runs")
stream.close()
deadline = time.monotonic() + 60
while True:
    after = metrics()
    aborted = after.get("vllm:request_success_total|finished_reason=abort", 0) - mid.get("vllm:request_success_total|finished_reason=abort", 0)
    if (after["vllm:num_requests_running"] == 0 and aborted == 1) or time.monotonic() > deadline:
        break
    time.sleep(0.1)
check(after["vllm:num_requests_running"] == 0, "after the client closed the stream, no request runs")
check(aborted == 1, "the closed stream's request finished as abort")
tokens = after["vllm:generation_tokens_total"] - mid["vllm:generation_tokens_total"]
check(0 < tokens < 64, f"it stopped after {tokens} of its 64 tokens")

# Still serving afterwards.
again = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
check(again.choices[0].text == full.choices[0].text, "a request after the disconnect gets the same greedy answer")
print("all streaming checks passed")
