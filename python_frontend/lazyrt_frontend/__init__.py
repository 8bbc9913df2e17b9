"""lazyrt_frontend: the RAG DSL (rag(), @function programs). Built in a later issue."""
