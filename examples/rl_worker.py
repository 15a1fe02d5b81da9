"""The seed's RL worker, unchanged except where the server is: ``TENSORSHARE_URL`` if set
(any address ``Client`` takes: ``tensorshare://HOST:PORT``, ``tensorshare+tls://HOST:PORT``),
else ``localhost`` on port ``TENSORSHARE_PORT`` (default 8000, the seed's).

Run it after ``examples/rl_trainer.py``; start as many as you like, whenever you like.
"""
import os

from tensorshare import RLWorker
import torch
from threading import Thread
from time import sleep

HOST = os.environ.get("TENSORSHARE_URL") or "localhost"
PORT = int(os.environ.get("TENSORSHARE_PORT", "8000"))


def generate_rollouts(ts):
    net = torch.nn.Linear(10, 2)

    try:
        # Load latest published parameters
        params = ts.get_parameters()
        if params is None:  # In case no parameters were available on the server
            params = ts.await_new_parameters(timeout=None)   # We wait until they are available
        net.load_state_dict(params)

        for _ in range(300):
            # Generate a rollout
            x = torch.randn(1, 10)
            ts.add_data(x)
            sleep(.2)
            # Load newest parameters
            params = ts.get_parameters()    # This returns the latest published parameters
            net.load_state_dict(params)
    finally:
        ts.stop()


tmp = RLWorker(HOST, PORT)
Thread(target=generate_rollouts, args=(tmp, ), daemon=True).start()
tmp.start()
