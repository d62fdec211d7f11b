"""The capture gateway: OpenAI-style chat completions in front of the capture path, one route per rollout.

:mod:`tasks.gateway.protocol` reads and refuses requests (under :mod:`tasks.gateway.limits`, the
body read by :mod:`tasks.gateway.body`), :mod:`tasks.gateway.shape` says what a request asks of its
captured call (:class:`~tasks.gateway.shape.CallShape`: tools, token cap),
:mod:`tasks.gateway.reply` reads the sampled text back into content and tool calls
(:mod:`tasks.gateway.tools`: the fallback tool format and vLLM's parser), :mod:`tasks.gateway.app`
is the HTTP face (keys, routes, streaming), :mod:`tasks.gateway.server` serves it on loopback inside
the generate attempt's event loop.
"""
