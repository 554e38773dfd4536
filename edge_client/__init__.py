"""The device runtime. The editing-session API is importable from here:
``from edge_client import AsyncDocument, Document, Suggestion, SuggestionStats``
(loaded on first use, so that ``import edge_client.x`` stays light)."""

_DOCUMENT_API = ("AsyncDocument", "Document", "Suggestion", "SuggestionStats")


def __getattr__(name: str):
    if name in _DOCUMENT_API:
        from edge_client import document

        return getattr(document, name)
    raise AttributeError(f"module 'edge_client' has no attribute {name!r}")
