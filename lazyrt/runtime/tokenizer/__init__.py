"""The tokenizer: text in, token ids out; sampled tokens in, text out. It runs in a process of its own,
or (--tokenizer-in-http) inside the HTTP process.

- process.py: TokenizerLoop: GenerateReq -> TokenizedReq towards the scheduler, TokenBatch ->
  TextBatch towards HTTP; finishes a request when a stop string appears; and its process loop.
- request_tokenizer.py: RequestTokenizer (validation, limits, errors that name the field).
- rag_template.py: chat templates with documents (the prompt as prefix, documents, question).
- doc_token_cache.py: a popular document's text is tokenized once.
- doc_refs.py: a request's documents by text or by id (stored token ids); registering a document.
- document_ops.py: the document store's operations (/v1/documents), run here beside the tokenizer.
- detokenizer.py: incremental detokenization (whole characters only, stop strings held back).

May import: lazyrt.documents, lazyrt.prompt, lazyrt.sampling_params, lazyrt.runtime.ipc,
lazyrt.cache (placement keys only)
"""
