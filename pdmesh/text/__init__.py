"""Text handling shared by the router and the engine, without torch or transformers: the
tokenizer (`tokenizer`), the chat template (`chat_template`) and incremental detokenization with
stop strings (`detokenizer`)."""
