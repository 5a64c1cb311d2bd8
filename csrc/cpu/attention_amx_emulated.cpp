// The amx_emulated tier's attention: attention_amx.cpp's kernel itself, compiled with the tile instructions emulated
// (amx_tiles.h, amx_emulation.cpp).
#define BF_AMX_EMULATED 1
#include "attention_amx.cpp"
