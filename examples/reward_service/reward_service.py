#!/usr/bin/env python3
"""A reward service for troupe's `http` reward kind, on the Python standard library only.

Run:   python3 examples/reward_service/reward_service.py --port 8765
Use:   rewards: [{name: judge, kind: http, url: http://127.0.0.1:8765/score, timeout_s: 10}]
Try:   curl -s localhost:8765/score -d '{"samples": [{"prompt": "", "completion": "#### 4", "metadata": {"answer": "4"}}]}'

Protocol (reward/http_reward.hpp): POST {"samples": [{"prompt", "completion", "metadata"}, ...]}
and reply {"scores": [one number per sample, in order]}. Replace `score` with your own judge.
"""
import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def score(prompt: str, completion: str, metadata: dict) -> float:
    # 1.0 when the reference answer appears after the completion's last "####", else 0.0.
    answer = str((metadata or {}).get("answer", "")).split("####")[-1].strip().replace(",", "")
    final = completion.split("####")[-1].strip().rstrip(".").replace(",", "").replace("$", "")
    return 1.0 if "####" in completion and answer and final == answer else 0.0


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        try:
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            scores = [score(s.get("prompt", ""), s["completion"], s.get("metadata")) for s in request["samples"]]
            self.reply(200, {"scores": scores})
        except (ValueError, KeyError, TypeError) as e:
            self.reply(400, {"error": f"bad request: {e}"})

    def reply(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"reward service on http://{args.host}:{server.server_port}/score", flush=True)
    server.serve_forever()
