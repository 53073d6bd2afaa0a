int nt_placeholder(void) { return 0; }
