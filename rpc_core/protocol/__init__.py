"""The protocol: what travels between workers, independent of how it travels.

wire.py           the frame format, the handshake's messages and every extras key (one page)
serialization.py  messages to frames: tensors out of band, metas in the head, pickle for the rest
torchscript.py    scripted functions and modules inside messages
"""
