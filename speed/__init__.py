"""Machine-specific speed paths, each optional and chosen by a flag; the tokens are the same without them:
packed.py (few-row products on weights packed once for MKL or oneDNN, --products), cppwrapper.py (inductor's C++
wrapper taught the layers' compile regions, --cpp-wrapper) and flex.py (FlexAttention block masks, --attention flex)."""
