"""The composition root: ``server.ControlPlane`` builds every stage, wires them together and
owns the one place a snapshot is rebuilt; ``cli`` is the ``infermesh-control-plane`` command.
Nothing below imports this package (``make lint`` checks it).
"""
