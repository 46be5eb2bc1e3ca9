"""A stand-in for ``python -m sglang.launch_server`` (CPU, no model) for the end-to-end test of
benchmarks/bench_sglang_server.py: the HTTP routes the benchmark uses (/health, /server_info,
/flush_cache, /abort_request, streamed /generate with input_ids) over a toy scheduler that
admits requests while its token pool has room, prefills before it decodes (as SGLang's
scheduler does), decodes all running requests one token per step, and logs SGLang's own
line formats (startup, "Prefill batch", "Decode batch" every few steps).

Tokens are a function of the prompt and position, so servers with and without
``--sparsehi-*`` flags agree. Knobs (environment): FAKE_SGLANG_TOKENS (pool tokens, 6000),
FAKE_SGLANG_STEP_S (decode step, 0.004), FAKE_SGLANG_PREFILL_S_PER_TOKEN (2e-5),
FAKE_SGLANG_LOG_INTERVAL (decode steps per log line, 5), FAKE_SGLANG_FAIL_IF (a flag that
makes the server exit at start), FAKE_SGLANG_REJECT_LEN (a prompt length /generate refuses).
"""
from __future__ import annotations

import json
import logging
import os
import queue
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger("fake_sglang")


class Req:
    def __init__(self, rid, ids, max_new):
        self.rid, self.ids, self.max_new = rid, ids, max_new
        self.out: list[int] = []
        self.events: "queue.Queue[dict | None]" = queue.Queue()
        self.aborted = False

    def token(self, k):
        return (sum(self.ids[:64]) * 31 + len(self.ids) * 7 + k * 13) % 1000 + 3


class Scheduler(threading.Thread):
    def __init__(self, capacity, step_s, prefill_s, interval, max_running):
        super().__init__(daemon=True)
        self.capacity, self.step_s, self.prefill_s, self.interval = capacity, step_s, prefill_s, interval
        self.max_running = max_running
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.used = 0
        self.lock = threading.Lock()
        self.ct = 0
        self.gen = 0
        self.tic = time.perf_counter()

    def add(self, r):
        with self.lock:
            self.waiting.append(r)

    def abort(self, rid=None):
        with self.lock:
            for lst in (self.waiting, self.running):
                for r in list(lst):
                    if rid is None or r.rid == rid:
                        lst.remove(r)
                        if lst is self.running:
                            self.used -= len(r.ids) + len(r.out)
                        r.events.put({"meta_info": {"completion_tokens": len(r.out), "cached_tokens": 0,
                                                    "finish_reason": {"type": "abort", "message": "aborted"}},
                                      "output_ids": list(r.out)})
                        r.events.put(None)

    def emit(self, r, finished):
        fr = {"type": "length", "length": r.max_new} if finished else None
        r.events.put({"output_ids": list(r.out), "meta_info": {"completion_tokens": len(r.out), "cached_tokens": 0,
                                                               "finish_reason": fr}})
        if finished:
            r.events.put(None)

    def run(self):
        while True:
            with self.lock:
                r = None
                if self.waiting and len(self.running) < self.max_running:
                    head = self.waiting[0]
                    if self.used + len(head.ids) + head.max_new <= self.capacity:
                        r = self.waiting.pop(0)
                        self.used += len(r.ids)
            if r is not None:  # prefill first, as SGLang does
                time.sleep(self.prefill_s * len(r.ids))
                with self.lock:
                    r.out.append(r.token(0))
                    self.used += 1
                    self.running.append(r)
                    log.info(f"Prefill batch, #new-seq: 1, #new-token: {len(r.ids)}, #cached-token: 0, "
                             f"token usage: {self.used / self.capacity:.2f}, #running-req: {len(self.running) - 1}, "
                             f"#queue-req: {len(self.waiting)}, #pending-token: 0, cuda graph: False, "
                             f"input throughput (token/s): 1000.00")
                    done = len(r.out) >= r.max_new
                    if done:
                        self.running.remove(r)
                        self.used -= len(r.ids) + len(r.out)
                    self.emit(r, done)
                continue
            with self.lock:
                batch = list(self.running)
            if not batch:
                time.sleep(0.002)
                continue
            time.sleep(self.step_s)
            with self.lock:
                for r in batch:
                    if r not in self.running:
                        continue
                    r.out.append(r.token(len(r.out)))
                    self.used += 1
                    self.gen += 1
                    done = len(r.out) >= r.max_new
                    if done:
                        self.running.remove(r)
                        self.used -= len(r.ids) + len(r.out)
                    self.emit(r, done)
                self.ct += 1
                if self.ct % self.interval == 0:
                    now = time.perf_counter()
                    thr = self.gen / (now - self.tic)
                    self.gen, self.tic = 0, now
                    log.info(f"Decode batch, #running-req: {len(batch)}, #token: {self.used}, "
                             f"token usage: {self.used / self.capacity:.2f}, cuda graph: True, "
                             f"gen throughput (token/s): {thr:.2f}, #queue-req: {len(self.waiting)}")


def main():
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S",
                        stream=sys.stderr)
    argv = sys.argv[1:]
    fail = os.environ.get("FAKE_SGLANG_FAIL_IF")
    if fail and fail in argv:
        log.error(f"ValueError: {fail} refused by the fake server")
        sys.exit(1)
    port = int(argv[argv.index("--port") + 1])
    plugins = os.environ.get("SGLANG_PLUGINS", "")
    if "sparsehi" in plugins.split(","):
        log.info("Loaded plugin sparsehi from group sglang.srt.plugins")
    else:
        log.info("Skipping plugin sparsehi (not in SGLANG_PLUGINS)")
    if any(a.startswith("--sparsehi-") for a in argv):
        log.info("sparsehi on: SparseConfig(algorithm='quest', ...)")
    cap = int(os.environ.get("FAKE_SGLANG_TOKENS", "6000"))
    max_running = 48
    sched = Scheduler(cap, float(os.environ.get("FAKE_SGLANG_STEP_S", "0.004")),
                      float(os.environ.get("FAKE_SGLANG_PREFILL_S_PER_TOKEN", "2e-5")),
                      int(os.environ.get("FAKE_SGLANG_LOG_INTERVAL", "5")), max_running)
    log.info(f"Load weight end. elapsed=0.01 s, type=LlamaForCausalLM, avail mem=60.00 GB, mem usage=15.00 GB.")
    log.info(f"KV Cache is allocated. dtype: torch.bfloat16, #tokens: {cap}, K size: 1.00 GB, V size: 1.00 GB")
    log.info(f"Capture decode cuda graph end. bs=[1, 2, 4, 8], elapsed=0.10 s, mem usage=0.50 GB, avail mem=5.00 GB.")
    log.info(f"max_total_num_tokens={cap}, chunked_prefill_size=8192, max_prefill_tokens=16384, "
             f"max_running_requests={max_running}, context_len=70000, available_gpu_mem=5.00 GB")
    sched.start()

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _send(self, code, body=b"", ctype="text/plain"):
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _body(self):
            n = int(self.headers.get("Content-Length", 0))
            return json.loads(self.rfile.read(n) or b"{}")

        def do_GET(self):
            if self.path == "/health":
                self._send(200)
            elif self.path == "/server_info":
                info = {"page_size": 1, "mem_fraction_static": 0.8, "max_running_requests": max_running,
                        "internal_states": [{"max_total_num_tokens": cap}], "version": "fake"}
                self._send(200, json.dumps(info).encode(), "application/json")
            else:
                self._send(404)

        def do_POST(self):
            body = self._body()
            if self.path == "/flush_cache":
                with sched.lock:
                    busy = bool(sched.waiting or sched.running)
                self._send(400 if busy else 200, b"Cache flushed.\n")
            elif self.path == "/abort_request":
                sched.abort(None if body.get("abort_all") else body.get("rid"))
                self._send(200)
            elif self.path == "/generate":
                if str(len(body["input_ids"])) == os.environ.get("FAKE_SGLANG_REJECT_LEN"):
                    self._send(400, json.dumps({"error": {"message": "rejected by the fake server"}}).encode(),
                               "application/json")
                    return
                sp = body.get("sampling_params", {})
                r = Req(body.get("rid") or f"r{id(body)}", body["input_ids"], int(sp.get("max_new_tokens", 16)))
                sched.add(r)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                while True:
                    ev = r.events.get()
                    if ev is None:
                        break
                    self.wfile.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                self.close_connection = True
            else:
                self._send(404)

    ThreadingHTTPServer.request_queue_size = 128  # socketserver's 5 would make some connects wait a SYN retry
    srv = ThreadingHTTPServer(("127.0.0.1", port), H)
    srv.daemon_threads = True
    time.sleep(0.3)
    log.info("The server is fired up and ready to roll!")
    srv.serve_forever()


if __name__ == "__main__":
    main()
