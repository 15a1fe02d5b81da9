"""The seed's RL trainer, unchanged except where its server listens: ``TENSORSHARE_URL`` if set
(``tensorshare://HOST:PORT`` or ``tensorshare+tls://HOST:PORT``; TLS with the certificate
``TENSORSHARE_TLS_CERT`` and ``TENSORSHARE_TLS_KEY`` name), else ``localhost`` on port
``TENSORSHARE_PORT`` (default 8000, the seed's).

It hosts the server itself. Start it, then one or more ``python examples/rl_worker.py``.
"""
import os

from tensorshare import RLTrainer
import torch
from threading import Thread
from time import sleep

HOST = os.environ.get("TENSORSHARE_URL") or "localhost"
PORT = int(os.environ.get("TENSORSHARE_PORT", "8000"))


def train(ts):
    net = torch.nn.Linear(10, 2)
    try:
        for i_iter in range(10):
            ts.publish_parameters(net.state_dict())

            # Aggregate a batch
            batch_size = 16
            data_buffer = torch.zeros(batch_size, 10)
            i = 0
            while i < batch_size:
                data = ts.get_data()
                for item in data:
                    data_buffer[i, :] = item
                    i += 1
                    if i == batch_size:
                        break
                sleep(.5)

            # Train on the batch
            loss = net(data_buffer).mean()
            print('Iteration', i_iter, 'Loss:', loss)
            loss.backward()
            with torch.no_grad():
                net.weight -= 0.001 * net.weight.grad
                net.weight.grad *= 0

            # Publish new parameters
            ts.publish_parameters(net.state_dict())
    finally:
        ts.stop()

# Also host the server. In a real application it's better to have a dedicated process host the server.
tmp = RLTrainer(HOST, PORT, host_server=True, filter_version=False)
Thread(target=train, args=(tmp, ), daemon=True).start()
tmp.start()
