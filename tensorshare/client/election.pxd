# Types for the compiled twin of election.py (tensorshare.client.election_c; see tensorshare._ext).
# The .py stays the reference: this file only declares what Cython may type.
