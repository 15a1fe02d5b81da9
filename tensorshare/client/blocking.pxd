# Types for the compiled twin of blocking.py (tensorshare.client.blocking_c; see tensorshare._ext).
# The .py stays the reference: this file only declares what Cython may type.
