"""A command agent for the tests that fails at once, as the worked example did on a Python without ``openai``.

It writes a traceback on stderr, naming its own key (``OPENAI_API_KEY``, which the receipt must keep
redacted), and exits 1 without calling the model: every rollout of its batch fails with ``agent_exit``.
"""

import os
import sys

print("Traceback (most recent call last):", file=sys.stderr)
print('  File "my_agent.py", line 3, in <module>', file=sys.stderr)
print("    import openai", file=sys.stderr)
print(f"ModuleNotFoundError: No module named 'openai' (key {os.environ['OPENAI_API_KEY']})", file=sys.stderr)
sys.exit(1)
