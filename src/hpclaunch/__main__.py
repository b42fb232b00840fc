from hpclaunch.cli import entrypoint

entrypoint()
