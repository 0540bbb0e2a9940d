"""`troupe serve` under abuse (issue 15): each case prints the HTTP status it got, or how it was shed.

Usage: serve_abuse.py TROUPE_BIN MODEL_DIR

Starts `troupe serve` on MODEL_DIR (the tiny arithmetic model: a random 2-layer Llama with the Qwen3
tokenizer, 160 tokens) on 127.0.0.1, any free port, one thread, with small limits; then sends bodies
over the size limit, slow clients, thousands of connections, invalid UTF-8, prompts past the
context, n and max_tokens at and past their limits, clients that go away mid-generation and weight
updates during generation. Each case must get the 4xx it names (with vLLM's error body naming the
problem), a 200 where the request is within the limits, or be shed (a deliberate 503, or the
connection closed). Then GET /health and a well-formed completion must still succeed, and SIGTERM
must stop the server with exit code 0. Exits 1 when the server crashed or hung, a case got another
answer, or any 5xx other than a deliberate 503 came back. Every wait is bounded.
"""
import http.client
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

BIN, MODEL = sys.argv[1:3]
MAX_SEQ_LEN, MAX_TOKENS, MAX_N, MAX_BODY, REQUEST_TIMEOUT, MAX_CONNECTIONS = 64, 32, 4, 1 << 20, 2, 256
VOCAB = 160
failures = []
server = None
port = 0
log = tempfile.NamedTemporaryFile(prefix="serve_abuse_", suffix=".log", delete=False)


def give_up(why):
    print("FAIL:", why, flush=True)
    if server and server.poll() is None:
        server.kill()
        server.wait(10)
    log.flush()
    with open(log.name, errors="replace") as f:
        tail = f.read()[-3000:]
    print("--- server stderr (tail) ---\n" + tail, flush=True)
    os._exit(1)


signal.signal(signal.SIGALRM, lambda *_: give_up("the script ran past 150 s: the server hangs"))
signal.alarm(150)


def alive():
    if server.poll() is not None:
        give_up(f"the server died (exit status {server.returncode})")


def show(outcome):
    """One line's worth of an outcome: a status and the error message, or how it was shed."""
    if isinstance(outcome, str):
        return outcome
    status, body = outcome
    message = ""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        message = " " + str(body["error"].get("message", ""))[:160]
    return f"{status}{message}"


def case(name, outcome, expected, check=None):
    """Prints the case and records a failure unless its outcome is one of `expected` (statuses, or
    "shed" for a closed or reset connection). `check(body)` may add a requirement on a 200 or 4xx."""
    alive()
    got = outcome if isinstance(outcome, str) else outcome[0]
    kind = "shed" if isinstance(got, str) and got.startswith("shed") else got
    ok = kind in expected
    if ok and not isinstance(outcome, str):
        status, body = outcome
        if status >= 400:
            e = body.get("error") if isinstance(body, dict) else None
            ok = isinstance(e, dict) and e.get("code") == status and isinstance(e.get("message"), str) and "type" in e
            if not ok:
                got = f"{status} without vLLM's error body: {str(body)[:120]}"
        if ok and check:
            problem = check(body)
            if problem:
                ok, got = False, problem
    if isinstance(kind, int) and kind >= 500 and kind != 503:
        ok = False
    print(f"{'ok  ' if ok else 'FAIL'} {name:<66} {show(outcome)}", flush=True)
    if not ok:
        failures.append(f"{name}: expected {expected}, got {got}")


def names(param, *words):
    """A check that the error names `param` and says each of `words`."""
    def check(body):
        e = body.get("error", {}) if isinstance(body, dict) else {}
        message = str(e.get("message", ""))
        if param is not None and e.get("param") != param:
            return f"param {e.get('param')!r}, not {param!r}: {message}"
        missing = [w for w in words if w not in message]
        return f"message lacks {missing}: {message}" if missing else None
    return check


def parse(raw):
    """(status, JSON body or text) of one raw HTTP/1.1 answer."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    try:
        return status, json.loads(rest.decode("utf-8"))  # strict UTF-8: an answer must be valid JSON text
    except (UnicodeDecodeError, ValueError):
        return status, rest.decode("utf-8", "replace")


def raw(data, timeout=10, linger=None):
    """Sends bytes on a new connection and reads the answer until the server closes it or the
    headers and Content-Length bytes have come; "shed: ..." when the connection closes first."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may answer and close before it has read everything
        out = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                return parse(out) if b"\r\n\r\n" in out else "shed: connection reset"
            except socket.timeout:
                return "FAIL: no answer within %d s" % timeout
            if not chunk:
                break
            out += chunk
            head, sep, rest = out.partition(b"\r\n\r\n")
            if sep:
                length = [int(l.split(b":")[1]) for l in head.split(b"\r\n") if l.lower().startswith(b"content-length:")]
                if length and len(rest) >= length[0]:
                    break
        if not out:
            return "shed: connection closed"
        return parse(out)
    finally:
        s.close()


def request(method, path, body=None, headers=None, timeout=30):
    """(status, JSON body) over http.client; `body` a dict (sent as JSON) or bytes."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        h = {"Content-Type": "application/json", **(headers or {})}
        c.request(method, path, body=data, headers=h)
        r = c.getresponse()
        text = r.read()
        try:
            return r.status, json.loads(text.decode("utf-8")) if text else None
        except (UnicodeDecodeError, ValueError):
            return r.status, text.decode("utf-8", "replace")
    except (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected):
        return "shed: connection closed"
    except socket.timeout:
        return f"FAIL: no answer within {timeout} s"
    finally:
        c.close()


def post(path, body, **kw):
    return request("POST", path, body, **kw)


def metrics():
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        key, value = line.rsplit(" ", 1)
        name, _, labels = key.partition("{")
        reason = [l.split("=")[1].strip('"') for l in labels.rstrip("}").split(",") if l.startswith("finished_reason=")]
        out[name + (":" + reason[0] if reason else "")] = float(value)
    return out


def wait_until(what, predicate, timeout=15):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    failures.append(f"timed out waiting for {what}")
    print(f"FAIL waiting for {what}", flush=True)
    return False


def completion(**kw):
    return {"prompt": "3+4=", "max_tokens": 4, "temperature": 0, **kw}


def http_post(path, body, extra=b""):
    """A raw POST of `body` (bytes) with Content-Length."""
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n".encode()
            + extra + b"\r\n" + body)


# ---------------------------------------------------------------------------------------
# The server.

soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
CONNECTIONS = 2000
if soft < CONNECTIONS + 256:  # thousands of sockets: the soft limit is often 1024
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, CONNECTIONS + 512), hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
CONNECTIONS = min(CONNECTIONS, soft - 200)

env = dict(os.environ, OMP_NUM_THREADS="1")
server = subprocess.Popen(
    [BIN, "serve", "--model", MODEL, "--host", "127.0.0.1", "--port", "0", "--served-model-name", "tiny",
     "--max-seq-len", str(MAX_SEQ_LEN), "--max-tokens", str(MAX_TOKENS), "--max-n", str(MAX_N), "--max-batch", "4",
     "--max-request-bytes", str(MAX_BODY), "--request-timeout", str(REQUEST_TIMEOUT),
     "--max-connections", str(MAX_CONNECTIONS), "--seed", "1"],
    stdout=subprocess.PIPE, stderr=log, env=env, text=True)
line = ""
deadline = time.monotonic() + 60
while "listening on" not in line and time.monotonic() < deadline and server.poll() is None:
    line = server.stdout.readline()
if "listening on" not in line:
    give_up("no listening line within 60 s")
port = int(line.rsplit(":", 1)[1])
print(f"troupe serve on port {port}: --max-seq-len {MAX_SEQ_LEN} --max-tokens {MAX_TOKENS} --max-n {MAX_N} "
      f"--max-batch 4 --max-request-bytes {MAX_BODY} --request-timeout {REQUEST_TIMEOUT} "
      f"--max-connections {MAX_CONNECTIONS}", flush=True)
case("a well-formed completion first", post("/v1/completions", completion()), {200})

# ---------------------------------------------------------------------------------------
print("\n# Bodies over the size limit")
body = json.dumps({"prompt": "1" * (MAX_BODY + 1)}).encode()
case("Content-Length over --max-request-bytes, body sent", raw(http_post("/v1/completions", body)), {413},
     names(None, "--max-request-bytes"))
case("Content-Length of 1 TB, 10 bytes sent",
     raw(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000000\r\n\r\n0123456789"), {413},
     names(None, "--max-request-bytes"))


def chunked(payload, size):
    out = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    for i in range(0, len(payload), size):
        piece = payload[i:i + size]
        out += b"%x\r\n" % len(piece) + piece + b"\r\n"
    return out + b"0\r\n\r\n"


case("chunked body just over the limit (64 KiB chunks)", raw(chunked(body, 65536)), {413}, names(None, "--max-request-bytes"))
case("chunked body of 3x the limit", raw(chunked(b"1" * (3 * MAX_BODY), 65536)), {413, "shed"})
case("chunked body within the limit is served", raw(chunked(json.dumps(completion()).encode(), 3)), {200})
case("form-urlencoded body over 8 KiB (curl -d)",
     post("/v1/completions", json.dumps(completion(stop=["x" * 9000])).encode(),
          headers={"Content-Type": "application/x-www-form-urlencoded"}), {413}, names(None, "application/json"))
case("headers of 100 KiB (200 lines)",
     raw(b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"a" * 500) for i in range(200)) + b"\r\n"),
     {431, "shed"})
case("one header line of 9000 bytes", raw(b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n"), {400, 431})
case("request line of 10000 bytes", raw(b"GET /" + b"a" * 10000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"), {414})
case("gzip Content-Encoding (a small bomb would inflate without limit)",
     raw(http_post("/v1/completions", b"\x1f\x8b" + b"\0" * 30, b"Content-Encoding: gzip\r\n")), {415},
     names(None, "Content-Encoding"))
case("Transfer-Encoding gzip", raw(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n"), {400},
     names(None, "Transfer-Encoding"))
case("JSON nested 400 000 deep (it overflowed the stack)",
     raw(http_post("/v1/completions", b'{"prompt":' + b"[" * 400000 + b"]" * 400000 + b"}")), {400}, names(None, "64 levels"))
case("JSON nested 65 deep", post("/v1/completions", b'{"prompt": "3+4=", "user": ' + b"[" * 65 + b"]" * 65 + b"}"), {400},
     names(None, "64 levels"))
case("POST without Content-Length: an empty body, answered at once", raw(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", timeout=1.5),
     {400}, names(None, "JSON object"))
case("garbage request line", raw(b"\x00\x01\x02 garbage\r\n\r\n"), {400})

# ---------------------------------------------------------------------------------------
print("\n# Slow clients")


def slowloris(count, first=b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", drip=b"X", every=0.25, until=None):
    """`count` connections that send `first`, then `drip` every `every` s, never finishing. Returns
    (outcomes, seconds until each was answered or closed)."""
    socks, outcomes, times = [], [], []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(first)
        socks.append([s, b"", None, time.monotonic()])
    start = time.monotonic()
    open_ = list(socks)
    while open_ and time.monotonic() - start < (until or REQUEST_TIMEOUT + 6):
        for entry in list(open_):
            s = entry[0]
            s.setblocking(False)
            try:
                chunk = s.recv(65536)
                if not chunk:
                    entry[2] = time.monotonic() - entry[3]
                    open_.remove(entry)
                else:
                    entry[1] += chunk
                    if b"\r\n\r\n" in entry[1]:
                        entry[2] = time.monotonic() - entry[3]
                        open_.remove(entry)
                    continue
            except BlockingIOError:
                pass
            except ConnectionResetError:
                entry[2] = time.monotonic() - entry[3]
                open_.remove(entry)
                continue
            try:
                s.send(drip)
            except (BrokenPipeError, ConnectionResetError, BlockingIOError):
                pass
        time.sleep(every)
    for s, got, t, _ in socks:
        s.close()
        outcomes.append(parse(got) if b"\r\n\r\n" in got else ("shed: connection closed" if t is not None else "still open"))
        times.append(t)
    return outcomes, times


def tally(outcomes):
    counts = {}
    for o in outcomes:
        key = o if isinstance(o, str) else o[0]
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n}x {k}" for k, n in sorted(counts.items(), key=str))


during = []


def served_meanwhile(delay=0.8):
    time.sleep(delay)
    for r in (request("GET", "/health", timeout=5), post("/v1/completions", completion(), timeout=5)):
        during.append(r)


t = threading.Thread(target=served_meanwhile)
t.start()
outcomes, times = slowloris(100)
t.join(10)
done = [x for x in times if x is not None]
case(f"100 connections sending headers a byte at a time: {tally(outcomes)}, after "
     f"{min(done, default=0):.1f}-{max(done, default=0):.1f} s",
     outcomes[0] if len(set(map(str, outcomes))) == 1 else f"mixed: {tally(outcomes)}", {408}, names(None, "--request-timeout"))
if any(x is None or x > REQUEST_TIMEOUT + 2 for x in times):
    failures.append(f"slow clients not cut off within {REQUEST_TIMEOUT + 2} s: {times}")
for r in during:
    case("  meanwhile a well-formed request (5 s timeout)", r, {200})
if len(during) != 2:
    failures.append("the well-formed requests during the slow clients did not both come back")

outcomes, times = slowloris(5, first=http_post("/v1/completions", b'{"prompt": "3+4=", "max_tokens": 2}' + b" " * 100)[:-90],
                            drip=b" ", every=0.3)
case(f"5 bodies sent a byte at a time: {tally(outcomes)}", outcomes[0], {408}, names(None, "--request-timeout"))

# Past --max-connections while every connection is busy: the new ones are shed with a 503.
during.clear()
t = threading.Thread(target=served_meanwhile, args=(0.5,))
t.start()
outcomes, times = slowloris(MAX_CONNECTIONS + 40)
t.join(10)
shed = [o for o in outcomes if not isinstance(o, str) and o[0] == 503]
case(f"{MAX_CONNECTIONS + 40} slow connections, {MAX_CONNECTIONS} allowed: {tally(outcomes)}",
     shed[0] if shed else "no 503", {503}, names(None, "--max-connections"))
if any(o == "still open" or (not isinstance(o, str) and o[0] not in (408, 503)) for o in outcomes):
    failures.append(f"slow connections past the limit: {tally(outcomes)}")
for r in during:
    case("  meanwhile a well-formed request (shed while all are busy)", r, {200, 503, "shed"})
case("after they are cut off, a well-formed request", post("/v1/completions", completion()), {200})

# ---------------------------------------------------------------------------------------
print("\n# Thousands of connections")
socks, refused = [], 0
start = time.monotonic()
for _ in range(CONNECTIONS):
    try:
        socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
    except OSError:
        refused += 1
opened = time.monotonic() - start
health = request("GET", "/health", timeout=10)
answer = post("/v1/completions", completion(), timeout=10)
time.sleep(0.5)
closed = still = 0
for s in socks:
    s.setblocking(False)
    try:
        closed += s.recv(1) == b""
    except BlockingIOError:
        still += 1
    except ConnectionResetError:
        closed += 1
    s.close()
case(f"{CONNECTIONS} idle connections in {opened:.1f} s ({refused} refused): {closed} closed by the server "
     f"(oldest idle first), {still} held; /health meanwhile", health, {200})
case(f"  a completion meanwhile", answer, {200})
if still > MAX_CONNECTIONS:
    failures.append(f"{still} connections held, more than --max-connections {MAX_CONNECTIONS}")

# ---------------------------------------------------------------------------------------
print("\n# Invalid UTF-8")
utf8_cases = [
    ("prompt with bytes FF FE", b'{"prompt": "3+\xff\xfe4=", "max_tokens": 2}', "/v1/completions"),
    ("chat message content with byte C3 alone", b'{"messages": [{"role": "user", "content": "hi \xc3 there"}]}',
     "/v1/chat/completions"),
    ("chat role with byte 80", b'{"messages": [{"role": "us\x80er", "content": "hi"}]}', "/v1/chat/completions"),
    ("JSON key with byte F5", b'{"pro\xf5mpt": "3+4="}', "/v1/completions"),
    ("lone surrogate escape \\ud800", b'{"prompt": "3+4=\\ud800"}', "/v1/completions"),
    ("overlong encoding C0 AF in a stop string", b'{"prompt": "3+4=", "stop": ["\xc0\xaf"]}', "/v1/completions"),
    ("truncated 3-byte sequence at the end of a string", b'{"prompt": "3+4=\xe2\x82"}', "/v1/completions"),
    ("encoded surrogate ED A0 80 in /tokenize", b'{"prompt": "\xed\xa0\x80"}', "/tokenize"),
]
for name, data, path in utf8_cases:
    case(name, post(path, data), {400}, names(None, "UTF-8" if b"\\ud800" not in data else "surrogate"))
# Token ids whose bytes are not UTF-8 on their own (byte-level BPE): the answers must still be valid JSON text.
case("/detokenize of ids that decode to lone bytes (150-159)", post("/detokenize", {"tokens": list(range(150, 160))}), {200})
case("completion on a prompt of lone-byte ids, 32 tokens, logprobs",
     post("/v1/completions", {"prompt": list(range(150, 160)), "max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 1,
                              "return_token_ids": True}), {200})
case("invalid UTF-8 in the request path", raw(b"GET /v1/mod\xffels HTTP/1.1\r\nHost: x\r\n\r\n"), {404})

# ---------------------------------------------------------------------------------------
print("\n# Prompts longer than the context")
case(f"{MAX_SEQ_LEN + 1} prompt token ids", post("/v1/completions", {"prompt": [5] * (MAX_SEQ_LEN + 1), "max_tokens": 1}),
     {400}, names("max_tokens", "maximum context length"))
case(f"{MAX_SEQ_LEN - 1} ids + max_tokens 1 (exactly the context)",
     post("/v1/completions", {"prompt": [5] * (MAX_SEQ_LEN - 1), "max_tokens": 1}), {200})
case(f"{MAX_SEQ_LEN} ids + max_tokens 1 (one past)", post("/v1/completions", {"prompt": [5] * MAX_SEQ_LEN, "max_tokens": 1}),
     {400}, names("max_tokens", "maximum context length"))
case(f"{MAX_SEQ_LEN + 1} ids without max_tokens", post("/v1/completions", {"prompt": [5] * (MAX_SEQ_LEN + 1)}), {400},
     names(None, "maximum context length"))
case("text of 200 000 characters", post("/v1/completions", {"prompt": "1+1=" * 50000, "max_tokens": 1}), {400},
     names("max_tokens", "maximum context length"))
case("text whose tokens are past the model's 160", post("/v1/completions", {"prompt": "Hello world"}), {400},
     names("prompt", "vocabulary"))
case("token id 160 (one past the vocabulary)", post("/v1/completions", {"prompt": [1, VOCAB]}), {400},
     names("prompt", "vocabulary"))
case("257 prompts in one request", post("/v1/completions", {"prompt": [[5]] * 257, "max_tokens": 1}), {400}, names("prompt"))

# ---------------------------------------------------------------------------------------
print("\n# n and max_tokens at their limits and past them")
at_limit = post("/v1/completions", {"prompt": "3+4=", "n": MAX_N, "max_tokens": MAX_TOKENS, "ignore_eos": True})
case(f"n = {MAX_N} (the limit) with max_tokens = {MAX_TOKENS} (the limit)", at_limit, {200},
     lambda b: None if len(b["choices"]) == MAX_N and b["usage"]["completion_tokens"] == MAX_N * MAX_TOKENS
     else f"{len(b['choices'])} choices, {b['usage']}")
for value, expected in ((MAX_N + 1, 400), (0, 400), (-1, 400), (2 ** 64, 400), (1.5, 400), ("2", 400), (True, 400)):
    case(f"n = {value!r}", post("/v1/completions", completion(n=value)), {expected}, names("n"))
for value in (MAX_TOKENS + 1, 0, -5, 2 ** 63, 1e300):
    case(f"max_tokens = {value!r}", post("/v1/completions", completion(max_tokens=value)), {400}, names("max_tokens"))
case(f"32 prompt ids + max_tokens {MAX_TOKENS} = the context",
     post("/v1/completions", {"prompt": [5] * (MAX_SEQ_LEN - MAX_TOKENS), "max_tokens": MAX_TOKENS, "ignore_eos": True}), {200})
case(f"33 prompt ids + max_tokens {MAX_TOKENS} = one past",
     post("/v1/completions", {"prompt": [5] * (MAX_SEQ_LEN - MAX_TOKENS + 1), "max_tokens": MAX_TOKENS}), {400},
     names("max_tokens", "maximum context length"))
case("logprobs = 21 (vLLM's limit is 20)", post("/v1/completions", completion(logprobs=21)), {400}, names("logprobs"))
case("4 prompts x n = 4 (16 samples on 4 slots)",
     post("/v1/completions", {"prompt": [[5, 6]] * 4, "n": MAX_N, "max_tokens": 8, "ignore_eos": True}), {200},
     lambda b: None if len(b["choices"]) == 16 else f"{len(b['choices'])} choices")

# ---------------------------------------------------------------------------------------
print("\n# Clients that go away mid-generation")
ABORTS = "vllm:request_success_total:abort"


def open_stream(body):
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(http_post("/v1/completions", json.dumps(body).encode()))
    return s


# Streamed: the first tokens arrive, the engine freezes (pause keep), the client leaves, the engine
# resumes. 4 prompts x n = 4 on 4 slots: 128 decode steps, so the pause lands mid-generation.
before = metrics()
SAMPLES = 4 * MAX_N
s = open_stream({"prompt": [[5, 6]] * 4, "n": MAX_N, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True})
got = b""
while b"data: {" not in got:
    chunk = s.recv(4096)
    if not chunk:
        break
    got += chunk
case("pause?mode=keep once the stream has its first token", post("/pause?mode=keep", {}), {200})
s.close()
time.sleep(1.5)  # the stream's next write (a keep-alive comment every second) finds the client gone
case("resume", post("/resume", {}), {200})
finished = lambda m: sum(m.get("vllm:request_success_total:" + r, 0) for r in ("stop", "length", "abort"))
wait_until("the closed stream's samples to finish", lambda: finished(metrics()) == finished(before) + SAMPLES)
after = metrics()
tokens = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
aborted = after.get(ABORTS, 0) - before.get(ABORTS, 0)
case(f"stream closed mid-generation: {aborted:.0f} of {SAMPLES} samples aborted, {tokens:.0f} of {SAMPLES * MAX_TOKENS} "
     f"tokens generated, running now {after['vllm:num_requests_running']:.0f}", "shed: connection closed by the client",
     {"shed"})
if not (0 < tokens < SAMPLES * MAX_TOKENS) or aborted < 1 or after["vllm:num_requests_running"] != 0:
    failures.append(f"the closed stream was not aborted: {aborted} aborted, {tokens} tokens, "
                    f"running {after['vllm:num_requests_running']}")

# Not streamed: the request waits in the frozen engine when the client leaves.
before = metrics()
case("pause?mode=keep", post("/pause?mode=keep", {}), {200})
s = open_stream({"prompt": [5, 6], "max_tokens": MAX_TOKENS, "n": 2, "ignore_eos": True})
wait_until("the request to reach the engine", lambda: metrics()["vllm:num_requests_waiting"] >= 2)
s.close()
time.sleep(0.5)
case("resume", post("/resume", {}), {200})
wait_until("the closed request's 2 samples to finish as abort", lambda: metrics().get(ABORTS, 0) == before.get(ABORTS, 0) + 2)
after = metrics()
case(f"non-streamed request closed by its client: {after.get(ABORTS, 0) - before.get(ABORTS, 0):.0f} samples aborted, "
     f"{after['vllm:generation_tokens_total'] - before['vllm:generation_tokens_total']:.0f} tokens generated",
     "shed: connection closed by the client", {"shed"})

for _ in range(20):  # and some that leave at once, streamed or not
    open_stream({"prompt": [5, 6], "max_tokens": MAX_TOKENS, "n": 2, "ignore_eos": True, "stream": _ % 2 == 0}).close()
wait_until("the 20 abandoned requests to finish", lambda: metrics()["vllm:num_requests_running"] == 0 and
           metrics()["vllm:num_requests_waiting"] == 0)
case("20 requests closed right after sending, then a well-formed one", post("/v1/completions", completion()), {200})

# ---------------------------------------------------------------------------------------
print("\n# Weight updates during generation")
work = tempfile.mkdtemp(prefix="serve_abuse_")
same = os.path.join(work, "same")
wrong = os.path.join(work, "wrong")
os.makedirs(same)
os.makedirs(wrong)
shutil.copy(os.path.join(MODEL, "model.safetensors"), same)  # the model's own tensors: a valid update
shutil.copy(os.path.join(MODEL, "reference.safetensors"), os.path.join(wrong, "model.safetensors"))  # not parameters

stop_load = threading.Event()
load_results = []


def load(stream):
    while not stop_load.is_set():
        body = {"prompt": [5, 6, 7], "max_tokens": MAX_TOKENS, "n": 2, "ignore_eos": True, "stream": stream}
        r = post("/v1/completions", body, timeout=30)
        if stream and not isinstance(r, str) and r[0] == 200:
            events = [json.loads(l[6:]) for l in r[1].split("\n") if l.startswith("data: {")] if isinstance(r[1], str) else []
            r = (200, {"choices": [c for e in events for c in e.get("choices", []) if c.get("finish_reason")],
                       "events": len(events), "error": next((e["error"] for e in events if "error" in e), None)})
        load_results.append(r)


loaders = [threading.Thread(target=load, args=(i == 0,)) for i in range(3)]
for t in loaders:
    t.start()
time.sleep(0.3)
version = request("GET", "/weight_info")[1]["weight_version"]
case("init_weight_transfer_engine (disk backend)", post("/init_weight_transfer_engine", {"init_info": {}}), {200})
case("pause?mode=keep during generation", post("/pause?mode=keep", {}), {200})
case("start_weight_update", post("/start_weight_update", {}), {200})
case("start_weight_update again (one session at a time)", post("/start_weight_update", {}), {409})
case("collective_rpc reload_weights while a session is open", post("/collective_rpc", {
    "method": "reload_weights", "kwargs": {"weights_path": same}}), {409})
case("update_weights with a folder of the model's tensors", post("/update_weights", {"update_info": {"path": same}}), {200})
case("finish_weight_update to version 5", post("/finish_weight_update", {"weight_version": "5"}), {200})
case("resume", post("/resume", {}), {200})
time.sleep(0.3)
results = []
threads = [threading.Thread(target=lambda: results.append(post("/collective_rpc", {
    "method": "reload_weights", "kwargs": {"weights_path": same}}))) for _ in range(3)]
for t in threads:
    t.start()
for t in threads:
    t.join(30)
case(f"3 concurrent collective_rpc reload_weights without a pause: {tally(results)}",
     results[0] if results else "FAIL: none came back", {200})
results = []
threads = [threading.Thread(target=lambda: results.append(post("/start_weight_update", {}))) for _ in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join(30)
case(f"2 concurrent start_weight_update: {tally(results)}", "ok" if sorted(r[0] for r in results) == [200, 409] else
     f"FAIL: {tally(results)}", {"ok"})
case("update_weights with tensors that are not parameters", post("/update_weights", {"update_info": {"path": wrong}}), {400},
     names("update_info.path", "not a parameter"))
case("finish_weight_update after the failed update (session ended)", post("/finish_weight_update", {}), {409})
case("update_weights with no session", post("/update_weights", {"update_info": {"path": same}}), {409})
case("update_weights with a relative path", post("/update_weights", {"update_info": {"path": "same"}}), {400},
     names("update_info.path", "absolute"))
case("pause?mode=wait while requests run (they finish first)", post("/pause?mode=wait", {}, timeout=60), {200})
case("a completion while paused with mode=wait", post("/v1/completions", completion()), {503})
case("update_weight_version to 9 while paused", post("/update_weight_version", {"new_version": 9}), {200})
case("resume", post("/resume", {}), {200})
time.sleep(0.5)
stop_load.set()
for t in loaders:
    t.join(60)
if any(t.is_alive() for t in loaders):
    give_up("generation requests did not come back within 60 s of the weight updates")
statuses = {}
for r in load_results:
    key = r if isinstance(r, str) else r[0]
    statuses[key] = statuses.get(key, 0) + 1
versions = sorted({(c["troupe"]["min_version"], c["troupe"]["max_version"]) for r in load_results if not isinstance(r, str)
                   and r[0] == 200 for c in r[1]["choices"]})
stream_errors = [r[1]["error"] for r in load_results if not isinstance(r, str) and r[0] == 200 and r[1].get("error")]
case(f"{len(load_results)} generation requests during the updates: {statuses}; (min, max) versions {versions}",
     "ok" if set(statuses) <= {200, 503} and statuses.get(200) and not stream_errors else f"FAIL: {statuses} {stream_errors}",
     {"ok"})
case("weight_info after", request("GET", "/weight_info"), {200},
     lambda b: None if b["weight_version"] == 9 else f"version {b['weight_version']}, not 9")
shutil.rmtree(work, ignore_errors=True)

# ---------------------------------------------------------------------------------------
print("\n# After all of it")
alive()
health = request("GET", "/health")
answer = post("/v1/completions", completion(max_tokens=8))
wait_until("nothing running or waiting (the loop counts its slots after the step that answered)",
           lambda: metrics()["vllm:num_requests_running"] == 0 and metrics()["vllm:num_requests_waiting"] == 0, timeout=10)
m = metrics()
case("GET /health", health, {200})
case(f"a well-formed completion: {answer[1]['choices'][0]['text']!r}" if not isinstance(answer, str) and answer[0] == 200
     else "a well-formed completion", answer, {200})
print(f"     metrics: running {m['vllm:num_requests_running']:.0f}, waiting {m['vllm:num_requests_waiting']:.0f}, "
      f"finished stop/length/abort {m.get('vllm:request_success_total:stop', 0):.0f}/"
      f"{m.get('vllm:request_success_total:length', 0):.0f}/{m.get(ABORTS, 0):.0f}", flush=True)
with open(log.name, errors="replace") as f:
    internal = [l for l in f if "internal error" in l]
if internal:
    failures.append(f"the server logged internal errors: {internal[:3]}")

second = subprocess.run([BIN, "serve", "--model", MODEL, "--host", "127.0.0.1", "--port", str(port)], env=env,
                        capture_output=True, text=True, timeout=60)
message = (second.stderr.strip().splitlines() or [""])[-1]
print(f"{'ok  ' if second.returncode != 0 and str(port) in message else 'FAIL'} a second troupe serve on port {port}: "
      f"exit {second.returncode}, {message}", flush=True)
if second.returncode == 0 or f"port {port}" not in message:
    failures.append(f"a second server on port {port} did not fail naming the port: {second.returncode} {message}")
case("the first server still answers", request("GET", "/health"), {200})

server.send_signal(signal.SIGTERM)
try:
    code = server.wait(30)
except subprocess.TimeoutExpired:
    give_up("the server did not stop within 30 s of SIGTERM")
print(f"SIGTERM: exit code {code}")
if code != 0:
    failures.append(f"exit code {code} after SIGTERM")
os.unlink(log.name)

if failures:
    print(f"\n{len(failures)} FAILURES:")
    for f in failures:
        print(" -", f)
    sys.exit(1)
print("\nall abuse cases answered or shed; the server still serves")
