"""A live PyTorch TCPStore for tests/torch_store.rs.

Usage: torch_store_server.py libuv|classic
Hosts a TCPStore server on 127.0.0.1 (a free port), prints "port N", then answers one command
per line on stdin with a Python client of the same store, so the test can check that what
tandem's client writes is what torch reads and the other way round:
  set KEY HEX | get KEY | add KEY N | check KEY... | numkeys | quit
Answers: "ok", "value HEX", "value N", "value True|False".
"""
import datetime
import sys

import torch.distributed as dist

backend = sys.argv[1]
server = dist.TCPStore(
    "127.0.0.1",
    0,
    is_master=True,
    wait_for_workers=False,
    use_libuv=(backend == "libuv"),
    timeout=datetime.timedelta(seconds=30),
)
client = dist.TCPStore(
    "127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=30)
)
print("port", server.port, "libuv", server.libuvBackend, flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "set":
        client.set(args[0], bytes.fromhex(args[1]))
        print("ok", flush=True)
    elif cmd == "get":
        print("value", client.get(args[0]).hex(), flush=True)
    elif cmd == "add":
        print("value", client.add(args[0], int(args[1])), flush=True)
    elif cmd == "check":
        print("value", client.check(args), flush=True)
    elif cmd == "numkeys":
        print("value", client.num_keys(), flush=True)
    elif cmd == "quit":
        break
