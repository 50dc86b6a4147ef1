"""Adapters for particular wrappers, at torchsnapshot's module paths (``torchsnapshot.tricks``)."""
