"""A stand-in for llama-server in tests: takes llama-server's flags, answers /health and streamed chat completions.

Every chat answer is the words "fake answer" cut to ``max_tokens`` pieces, streamed as OpenAI SSE
chunks with a final usage chunk; ``POST /completion`` (llama-server's own endpoint) streams
``n_predict`` pieces as llama-server does, the last event with ``stop`` and ``tokens_predicted``.
``--record FILE`` appends every request body to FILE as a JSON line. ``--fail`` makes it print a
line and exit 3 at once (a server that cannot start).
"""

from __future__ import annotations

import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

WORDS = ["fake", " answer", " from", " the", " stand", "-in", " peer", "."]


class Handler(BaseHTTPRequestHandler):
    def log_message(self, fmt: str, *args: object) -> None:  # quiet
        pass

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        body = json.dumps({"status": "ok"} if self.path == "/health" else {"data": [{"id": "fake"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        record = self.server.record  # type: ignore[attr-defined]
        if record:
            with open(record, "a") as f:
                f.write(json.dumps({"path": self.path, **req}) + "\n")
        if self.path == "/completion":
            self._completion(req)
            return
        pieces = WORDS[: req.get("max_tokens", 4)]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        base = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "fake"}
        for i, piece in enumerate(pieces):
            finish = "length" if i == len(pieces) - 1 else None
            event = {**base, "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": finish}]}
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        usage = {"prompt_tokens": 10, "completion_tokens": len(pieces), "total_tokens": 10 + len(pieces)}
        self.wfile.write(f"data: {json.dumps({**base, 'choices': [], 'usage': usage})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def _completion(self, req: dict) -> None:
        n = int(req.get("n_predict", 4))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(n):
            self.wfile.write(f"data: {json.dumps({'content': WORDS[i % len(WORDS)], 'stop': False})}\n\n".encode())
        last = {"content": "", "stop": True, "tokens_predicted": n, "timings": {"predicted_n": n}}
        self.wfile.write(f"data: {json.dumps(last)}\n\n".encode())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--fail", action="store_true")
    parser.add_argument("--record", default=None)
    args, _ = parser.parse_known_args()  # llama-server's other flags are accepted and ignored
    if args.fail:
        print("error: fake llama-server failed to load the model", flush=True)
        sys.exit(3)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.record = args.record  # type: ignore[attr-defined]
    server.serve_forever()


if __name__ == "__main__":
    main()
