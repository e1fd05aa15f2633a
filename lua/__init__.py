"""The Lua (Redis Functions) library of capsvc, shipped as package data of capsvc.lua."""
