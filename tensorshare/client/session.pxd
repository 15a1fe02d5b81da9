# Types for the compiled twin of session.py (tensorshare.client.session_c; see tensorshare._ext).
# The .py stays the reference: this file only declares what Cython may type.
