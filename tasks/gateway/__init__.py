"""The capture gateway: OpenAI-style chat completions in front of the capture path, one route per rollout.

:mod:`tasks.gateway.protocol` reads and refuses requests, :mod:`tasks.gateway.app` is the HTTP
face (keys, routes, streaming), :mod:`tasks.gateway.server` serves it on loopback inside the
generate attempt's event loop.
"""
