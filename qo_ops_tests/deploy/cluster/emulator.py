"""Test scaffolding, never shipped: a Kubernetes API for the image's real K8sRunLauncher.

kmock's ``KubernetesEmulator`` keeps the objects it is sent in memory and serves them back
(create, get, list, patch, delete, watch) on a loopback port. It runs no controllers and
ignores label selectors: ``kubelet.py`` plays the node, a test plays ``kubectl``.

    python -m qo_ops_tests.deploy.cluster.emulator PORT

prints ``ready`` once it listens, and serves until it is sent SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import kmock

# What the launcher, the kubelet and the tests touch; listing a resource needs it declared.
RESOURCES = ("batch/v1/jobs", "v1/pods", "v1/configmaps", "v1/secrets", "v1/serviceaccounts")


async def serve(port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with kmock.KubernetesEmulator() as emulator:
        for name in RESOURCES:
            emulator.resources[name] = kmock.ResourceInfo()
        async with kmock.Server(emulator, host="127.0.0.1", port=port):
            print("ready", flush=True)
            await stop.wait()


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1])))
