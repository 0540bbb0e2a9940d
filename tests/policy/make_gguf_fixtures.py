import os, sys
os.makedirs(sys.argv[1], exist_ok=True)
