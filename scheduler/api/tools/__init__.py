"""Tool calling: tool definitions checked (``spec``), a model family's call
format (``formats``: Hermes/Qwen, Llama 3, Mistral, generic), the grammar
that holds calls to the tools' schemas (``grammar``), and the incremental
parser that turns output text into OpenAI tool-call deltas (``stream``)."""
